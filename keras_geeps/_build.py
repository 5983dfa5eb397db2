"""Builds the keras_geeps custom-op library against the installed TensorFlow.

The ops are C++ (and, where nvcc is found, CUDA) sources compiled with the
flags `tf.sysconfig` gives, because a TensorFlow custom op must be built
against the exact TensorFlow it loads into. The result is cached in a folder
keyed by a hash of every source file, the TensorFlow version and whether CUDA
was built, so a changed source or a new TensorFlow gets a fresh build and an
unchanged one is reused. A file lock makes processes that import at once
build it once.

Where the library goes: `$KERAS_GEEPS_OPS_DIR` if set, else `_lib/` next to
this package when writable, else `$XDG_CACHE_HOME/keras_geeps` (by default
`~/.cache/keras_geeps`).

Environment:
    KERAS_GEEPS_OPS_DIR: cache folder (see above).
    KERAS_GEEPS_CUDA: "1" to require the CUDA kernels, "0" to leave them out.
        Unset: built when nvcc is found and TensorFlow was built with CUDA.
    KERAS_GEEPS_NVCC: the nvcc to use (default: `nvcc` on PATH, then
        /usr/local/cuda/bin/nvcc).
    KERAS_GEEPS_CUDA_ARCHS: semicolon-separated compute capabilities to build
        machine code for (default "75;80;86;89;90"); PTX of the last is added.
    CXX: the C++ compiler (default g++).

Example:

```
python -m keras_geeps._build            # build unless cached; print the path
python -m keras_geeps._build --force    # rebuild from scratch
python -m keras_geeps._build --no-cuda  # CPU kernels only
```
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

LIBRARY_NAME = "_geeps_ops.so"
INFO_NAME = "build_info.json"
DEFAULT_CUDA_ARCHS = "75;80;86;89;90"
MAX_JOBS = 2
LOCK_TIMEOUT_S = 1800
_SOURCE_SUFFIXES = (".cc", ".h", ".cu", ".cuh")

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """The custom-op library could not be built; the message says why."""


def sources_dir():
    """The folder holding the op sources (`cc/ops`, `cc/kernels`).

    Installed copies carry them as package data in `keras_geeps/_ops_src`; a
    source checkout has them in `ops/` beside the package.

    Returns:
        A `pathlib.Path`.
    """
    for candidate in (_PACKAGE_DIR / "_ops_src", _PACKAGE_DIR.parent / "ops"):
        if (candidate / "cc").is_dir():
            return candidate
    raise BuildError(
        f"keras_geeps: no op sources in {_PACKAGE_DIR / '_ops_src'} or "
        f"{_PACKAGE_DIR.parent / 'ops'}; reinstall keras_geeps.")


def _source_files(root):
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.name.endswith(_SOURCE_SUFFIXES))


def _is_cuda_source(path):
    return path.name.endswith((".cu.cc", ".cu"))


def cache_root():
    """The folder that holds the per-key build folders (created if needed)."""
    override = os.environ.get("KERAS_GEEPS_OPS_DIR")
    if override:
        root = pathlib.Path(override).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        return root
    beside = _PACKAGE_DIR / "_lib"
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK | os.X_OK):
            return beside
    except OSError:
        pass
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    root = pathlib.Path(xdg) / "keras_geeps"
    root.mkdir(parents=True, exist_ok=True)
    return root


def find_nvcc():
    """The nvcc to build with, or None when there is none."""
    explicit = os.environ.get("KERAS_GEEPS_NVCC")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise BuildError(f"KERAS_GEEPS_NVCC={explicit} is not executable")
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def _want_cuda(cuda):
    """Resolves the `cuda` argument (None = environment, then auto)."""
    if cuda is None:
        env = os.environ.get("KERAS_GEEPS_CUDA", "").strip()
        if env in ("0", "1"):
            cuda = env == "1"
        elif env:
            raise BuildError(f"KERAS_GEEPS_CUDA must be 0 or 1, not {env!r}")
    if cuda is None:
        import tensorflow as tf  # noqa: PLC0415
        return find_nvcc() is not None and tf.test.is_built_with_cuda()
    if cuda and find_nvcc() is None:
        raise BuildError(
            "a CUDA build was asked for but no nvcc was found; put nvcc on "
            "PATH or set KERAS_GEEPS_NVCC, or build without CUDA "
            "(KERAS_GEEPS_CUDA=0)")
    return bool(cuda)


def _cuda_archs():
    archs = [a.strip() for a in os.environ.get(
        "KERAS_GEEPS_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).split(";") if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        raise BuildError("KERAS_GEEPS_CUDA_ARCHS must look like '80;90'")
    return archs


def build_key(cuda):
    """The cache key: sources, this build script (its flags), the C++
    compiler named by CXX, TensorFlow version, CUDA or not (with its archs
    and nvcc).

    Args:
        cuda: bool, whether the CUDA kernels are built.

    Returns:
        A folder name such as `tf2.21.0-cpu-0123456789abcdef`.
    """
    import tensorflow as tf  # noqa: PLC0415
    root = sources_dir()
    digest = hashlib.sha256()
    for path in _source_files(root):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    digest.update(pathlib.Path(__file__).read_bytes())  # flags, steps
    digest.update(os.environ.get("CXX", "g++").encode() + b"\0")
    digest.update(tf.__version__.encode())
    if cuda:
        digest.update(";".join(_cuda_archs()).encode())
        digest.update(str(find_nvcc()).encode())
    kind = "cuda" if cuda else "cpu"
    return f"tf{tf.__version__}-{kind}-{digest.hexdigest()[:16]}"


def _cuda_runtime(nvcc):
    """(libcudart_static.a path, CUDA version string) of an nvcc install."""
    # nvcc may be a wrapper script; its dry run names its real install.
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull,
                          "-o", os.devnull], capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.*)$", out.stderr + out.stdout, re.M)
    roots = [pathlib.Path(top.group(1).strip())] if top else []
    roots.append(pathlib.Path(nvcc).resolve().parent.parent)
    for root in roots:
        for lib_dir in [root / "lib64", root / "lib",
                        *sorted(root.glob("targets/*/lib"))]:
            if (lib_dir / "libcudart_static.a").is_file():
                version = subprocess.run([nvcc, "--version"],
                                         capture_output=True, text=True).stdout
                release = re.search(r"release ([\d.]+)", version)
                return (lib_dir / "libcudart_static.a",
                        release.group(1) if release else "unknown")
    raise BuildError(f"no libcudart_static.a found beside {nvcc}")


def _run(command, cwd):
    try:
        proc = subprocess.run(command, cwd=cwd, capture_output=True,
                              text=True)
    except OSError as exc:  # no such program, not executable, ...
        raise BuildError(
            f"keras_geeps: building the custom ops failed: cannot run the "
            f"compiler {command[0]!r} ({exc.strerror or exc}). Install it or "
            f"name another: CXX for the C++ compiler (default g++), "
            f"KERAS_GEEPS_NVCC for nvcc.\n$ {' '.join(command)}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-6000:]
        raise BuildError(
            f"keras_geeps: building the custom ops failed.\n$ "
            f"{' '.join(command)}\n{tail}")
    return proc


def _compile_and_link(src_root, out_dir, cuda):
    """Compiles every source into `out_dir` and links LIBRARY_NAME there."""
    import tensorflow as tf  # noqa: PLC0415
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    # TensorFlow's headers as system headers: their warnings are not ours.
    tf_flags = [f"-isystem{f[2:]}" if f.startswith("-I") else f
                for f in tf.sysconfig.get_compile_flags()]
    cxx_flags = ["-O3", "-fPIC", "-Wall", "-DNDEBUG", *tf_flags]
    if cuda:
        cxx_flags.append("-DGOOGLE_CUDA=1")
    commands = []
    objects = []
    for path in _source_files(src_root):
        if path.suffix in (".h", ".cuh") or (
                _is_cuda_source(path) and not cuda):
            continue
        obj = out_dir / (path.relative_to(src_root).as_posix()
                         .replace("/", "__") + ".o")
        objects.append(obj)
        if _is_cuda_source(path):
            archs = _cuda_archs()
            gencode = []
            for arch in archs:
                gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
            # PTX of the newest arch too, for GPUs newer than the list.
            gencode += ["-gencode",
                        f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
            commands.append([find_nvcc(), "-x", "cu", "-std=c++17", "-O3",
                             "-Xcompiler", "-fPIC", *gencode, "-c", str(path),
                             "-o", str(obj)])
        else:
            commands.append([*cxx, *cxx_flags, "-c", str(path), "-o",
                             str(obj)])
    jobs = max(1, min(MAX_JOBS, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for future in [pool.submit(_run, c, out_dir) for c in commands]:
            future.result()
    link = [*cxx, "-shared", "-o", str(out_dir / LIBRARY_NAME),
            *map(str, objects)]
    cuda_version = None
    if cuda:
        cudart, cuda_version = _cuda_runtime(find_nvcc())
        # The CUDA runtime linked in statically, its symbols hidden, so the
        # library loads where no CUDA runtime is installed and its kernels
        # run on the runtime they were compiled for. Before TensorFlow's
        # library: that one exports a CUDA runtime stub of its own version,
        # which would otherwise satisfy every cuda* symbol first.
        link += [str(cudart), "-ldl", "-lrt", "-lpthread",
                 "-Wl,--exclude-libs,ALL"]
    link += [*tf.sysconfig.get_link_flags(), "-Wl,--no-undefined"]
    _run(link, out_dir)
    for obj in objects:
        obj.unlink()
    return cuda_version


def build(force=False, cuda=None):
    """Builds the custom-op library unless a matching one is cached.

    Safe to call from several processes at once: one builds, the others wait
    for it and reuse its result.

    Args:
        force: bool, rebuild even if a matching library is cached. Defaults to
            False.
        cuda: bool or None, whether to build the CUDA kernels; None follows
            `KERAS_GEEPS_CUDA`, else builds them when nvcc is found and
            TensorFlow has CUDA. Defaults to None.

    Returns:
        The path (str) of the library.

    Raises:
        BuildError: when a compiler is missing or compilation fails; the
            message holds the failing command and its output.

    Example:

    ```python
    from keras_geeps import _build
    path = _build.build()
    ```
    """
    import filelock  # noqa: PLC0415
    cuda = _want_cuda(cuda)
    root = cache_root()
    key = build_key(cuda)
    final = root / key
    library = final / LIBRARY_NAME

    def cached():
        return library.is_file() and (final / INFO_NAME).is_file()

    if not force and cached():
        return str(library)
    lock = filelock.FileLock(str(root / f"{key}.lock"), timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            if not force and cached():
                return str(library)  # built by another process meanwhile
            staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}-",
                                                    dir=root))
            # mkdtemp's 0700 would hide it from others
            os.chmod(staging, 0o755)
            try:
                start = time.monotonic()
                src_root = sources_dir()
                cuda_version = _compile_and_link(src_root, staging, cuda)
                import tensorflow as tf  # noqa: PLC0415
                info = {
                    "tf_version": tf.__version__,
                    "cuda": cuda,
                    "cuda_version": cuda_version,
                    "cuda_archs": _cuda_archs() if cuda else [],
                    "key": key,
                    "sources": str(src_root),
                    "build_seconds": round(time.monotonic() - start, 1),
                }
                (staging / INFO_NAME).write_text(json.dumps(info, indent=1))
                if final.exists():
                    # A process that loaded the old library keeps its mapping.
                    old = pathlib.Path(tempfile.mkdtemp(prefix=f".old-{key}-",
                                                        dir=root))
                    os.replace(final, old / key)
                    shutil.rmtree(old, ignore_errors=True)
                os.replace(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            if root == _PACKAGE_DIR / "_lib":
                _prune_stale(root, key)
    except filelock.Timeout as exc:
        raise BuildError(
            f"keras_geeps: waited {LOCK_TIMEOUT_S} s for another process "
            f"building the ops (lock {lock.lock_file}); remove the lock file "
            "if no build is running") from exc
    return str(library)


def _prune_stale(root, key):
    """Removes this checkout's builds of older sources (same TF and kind),
    and the staging folders of builds that were killed (SIGKILL skips
    their cleanup): `.<key>-*` ones are leftovers, since the caller holds
    `key`'s lock, and so are those of older sources.

    Only in the package's own `_lib/`: a shared cache folder may serve other
    checkouts whose sources differ. A process that loaded a removed library
    keeps its mapping.
    """
    prefix = key.rsplit("-", 1)[0] + "-"
    for path in root.glob(prefix + "*"):
        if path.name.startswith(key):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.suffix == ".lock":
            path.unlink(missing_ok=True)
    for path in [*root.glob(f".{prefix}*"), *root.glob(f".old-{prefix}*")]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def build_info(library_path):
    """The build record written beside a library (dict; empty if none)."""
    info = pathlib.Path(library_path).parent / INFO_NAME
    try:
        return json.loads(info.read_text())
    except (OSError, ValueError):
        return {}


def add_arguments(parser):
    """Adds the build's flags (`--force`, `--cuda` / `--no-cuda`) to an
    argparse parser: `python -m keras_geeps._build`'s, and
    `keras-geeps build-ops`'."""
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if a matching library is cached")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cuda", dest="cuda", action="store_true",
                       default=None, help="require the CUDA kernels")
    group.add_argument("--no-cuda", dest="cuda", action="store_false",
                       help="build the CPU kernels only")


def main(argv=None, args=None):
    """`python -m keras_geeps._build`: build the ops now, print the path.

    Args:
        argv: the command line's arguments (default: sys.argv[1:]).
        args: arguments parsed already (`add_arguments`), instead.
    """
    if args is None:
        parser = argparse.ArgumentParser(
            prog="python -m keras_geeps._build",
            description="Build the keras_geeps custom TensorFlow ops.")
        add_arguments(parser)
        args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        path = build(force=args.force, cuda=args.cuda)
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    info = build_info(path)
    kind = f"CUDA {info.get('cuda_version')}" if info.get("cuda") else "CPU"
    seconds = time.monotonic() - start
    print(f"keras_geeps ops ({kind} kernels, TensorFlow "
          f"{info.get('tf_version')}) ready in {seconds:.1f} s:")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
