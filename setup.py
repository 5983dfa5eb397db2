"""keras_geeps: a GeePS-style parameter server for Keras 3 and TensorFlow.

The custom TensorFlow ops are compiled against the installed TensorFlow,
not here (an isolated pip build cannot import TensorFlow): on first import
of `keras_geeps.ops`, or ahead of time with `keras-geeps build-ops`. Their
C++/CUDA sources travel inside the package as `keras_geeps/_ops_src`.
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
AEGIS = "pyaegis>=0.3.1,<0.4"  # the sealed channel's cipher (extra "curve")


class BuildPyWithOpSources(build_py):
    """Copies ops/ into the built package so installed copies can compile."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "keras_geeps", "_ops_src")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "ops"), target)


setup(
    name="keras-geeps",
    version="0.1.0",
    description="GeePS-style parameter server for Keras 3 and TensorFlow",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    # what CI tests; pyaegis (the "curve" extra) needs it
    python_requires=">=3.11",
    packages=find_packages(include=["keras_geeps", "keras_geeps.*"]),
    install_requires=[
        "tensorflow==2.21.*",
        "numpy",
        "pyzmq>=25",
        "msgpack>=1.0",
        "tensorflow-datasets",
        "importlib_resources",  # tensorflow-datasets needs it on 3.11
        "filelock",  # one build of the ops when processes import at once
    ],
    extras_require={
        # CURVE jobs' sealed data channel: AEGIS-256X4 (libaegis). pyaegis
        # builds from source (a C compiler), so only jobs with keys need
        # it; its cffi module is used directly (no copies), hence the pin.
        "curve": [AEGIS],
        # pycodestyle and pyflakes (PyCQA): tests/test_style.py keeps the
        # code PEP 8 and free of unused imports and undefined names
        "test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn",
                 "pycodestyle", "pyflakes", AEGIS],
    },
    entry_points={"console_scripts": ["keras-geeps=keras_geeps.cli:main"]},
    cmdclass={"build_py": BuildPyWithOpSources},
)
