"""What sealing adds to a 16 MB push+pull round trip, pass by pass.

`fault_bench.py`'s `curve_vs_plain` compares a sealed round trip with a
plain one. This script times, on the same 16 MB of float32 rows, the
memory passes in which the two differ, so the gap can be told apart from
the wire:

- the shard adding an update to its rows: plain, one pass from the
  received frame and the base into the clock's rows; sealed, the frame
  opened into the rows, then the base added in place (`Pending.add_sealed`);
- the worker sealing its update and the shard sealing the push (plain
  sends both where they lie);
- the worker opening the push into a read's buffer (plain: a copy);
- a blocked open+add (libaegis' incremental API, 1 MB blocks), to see
  whether fusing the shard's two passes would pay.

Example:

    .venv/bin/python benchmarks/seal_passes.py

The last line is JSON: each pass's median in ms and `predicted_extra_ms`,
the sum of what sealing adds to one round trip.
"""

import json
import os
import time

import numpy as np

from keras_geeps import seal

NBYTES = 16 << 20
TAG = seal.TAG_BYTES
REPEATS = 40


def _median_ms(fn):
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)) * 1e3, 3)


def main():
    ffi, lib = seal._aegis()  # noqa: SLF001 (the same cipher the channel
    encrypt = getattr(lib, f"{seal.CIPHER}_encrypt")  # uses, called bare)
    decrypt = getattr(lib, f"{seal.CIPHER}_decrypt")
    key, nonce, aad = os.urandom(32), os.urandom(32), b"seal_passes"
    rng = np.random.default_rng(0)
    update = rng.random(NBYTES // 4, np.float32)
    base = rng.random(NBYTES // 4, np.float32)
    rows = np.empty_like(update)
    sealed = np.empty(NBYTES + TAG, np.uint8)
    out = ffi.from_buffer

    def seal_update():
        encrypt(out(sealed, require_writable=True), TAG, out(update),
                NBYTES, aad, len(aad), nonce, key)

    def open_into_rows():
        if decrypt(out(rows, require_writable=True), out(sealed),
                   NBYTES + TAG, TAG, aad, len(aad), nonce, key):
            raise RuntimeError("the frame does not authenticate")

    def open_then_add():
        open_into_rows()
        np.add(rows, base, out=rows)

    state = ffi.new(f"{seal.CIPHER}_state *")
    init = getattr(lib, f"{seal.CIPHER}_state_init")
    update_block = getattr(lib, f"{seal.CIPHER}_state_decrypt_update")
    final = getattr(lib, f"{seal.CIPHER}_state_decrypt_final")

    def open_add_blocked(block=1 << 20):
        init(state, aad, len(aad), nonce, key)
        target, source = out(rows, require_writable=True), out(sealed)
        for offset in range(0, NBYTES, block):
            if update_block(state, target + offset, source + offset,
                            block):
                raise RuntimeError("incremental open failed")
            part = slice(offset // 4, (offset + block) // 4)
            np.add(rows[part], base[part], out=rows[part])
        if final(state, source + NBYTES, TAG):
            raise RuntimeError("the frame does not authenticate")

    seal_update()
    open_then_add()
    expected = rows.copy()
    open_add_blocked()
    if not np.array_equal(rows, expected):
        raise RuntimeError("the blocked open+add differs from one-shot")

    figures = {
        "plain_shard_add_ms": _median_ms(
            lambda: np.add(update, base, out=rows)),
        "sealed_shard_open_add_ms": _median_ms(open_then_add),
        "blocked_open_add_ms": _median_ms(open_add_blocked),
        "seal_ms": _median_ms(seal_update),
        "open_ms": _median_ms(open_into_rows),
        "copy_ms": _median_ms(lambda: np.copyto(rows, update)),
    }
    # Sealed minus plain: the shard's second pass, two seals (update and
    # push), and opening the push instead of copying it.
    figures["predicted_extra_ms"] = round(
        figures["sealed_shard_open_add_ms"] - figures["plain_shard_add_ms"]
        + 2 * figures["seal_ms"]
        + figures["open_ms"] - figures["copy_ms"], 3)
    for name, value in figures.items():
        print(f"{name:>26}: {value:.3f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
