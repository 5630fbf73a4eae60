"""The copy of a one-PE (local) S1 rechunk on one GPU, against a device-to-device copy of the same bytes.

    python3 scripts/gpu/probe_local_copy.py --size 16GiB

Column slabs (N, N/4) -> row slabs (N/4, N), as ``dask_pgas``'s local plan builds each output chunk: CuPy
strided assignment of each piece (``out[rows, cols] = chunk[rows, :]``), versus ``cudaMemcpy2DAsync`` of the
same pieces, versus one contiguous ``cupy`` copy of all the bytes. CUDA events, median of 5 after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="16GiB")
    ap.add_argument("--parts", type=int, default=4)
    args = ap.parse_args()

    import cupy
    from dask.utils import parse_bytes

    p = args.parts
    n = int((parse_bytes(args.size) / 8) ** 0.5) // p * p
    w = n // p
    cols = [cupy.ones((n, w)) for _ in range(p)]
    rows = [cupy.empty((w, n)) for _ in range(p)]
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    stream = cupy.cuda.get_current_stream()

    def timed(fn):
        times = []
        for i in range(6):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            if i:
                times.append(cupy.cuda.get_elapsed_time(start, stop))
        return statistics.median(times)

    def strided():
        for i, out in enumerate(rows):
            for j, src in enumerate(cols):
                out[:, j * w:(j + 1) * w] = src[i * w:(i + 1) * w, :]

    def memcpy2d():
        rt = cupy.cuda.runtime
        for i, out in enumerate(rows):
            for j, src in enumerate(cols):
                s = src[i * w:(i + 1) * w, :]
                d = out[:, j * w:(j + 1) * w]
                rt.memcpy2DAsync(d.data.ptr, d.strides[0], s.data.ptr, s.strides[0], w * 8, w,
                                 rt.memcpyDeviceToDevice, stream.ptr)

    def whole():
        for out, src in zip(rows, cols):
            cupy.copyto(out.reshape(-1), src.reshape(-1))

    res = {"n": n, "bytes": n * n * 8}
    for name, fn in (("d2d_ms", whole), ("cupy_strided_ms", strided), ("memcpy2d_ms", memcpy2d)):
        res[name] = round(timed(fn), 3)
    for i in range(p):  # the strided result is right
        for j, src in enumerate(cols):
            src[i * w:(i + 1) * w, :] = i * p + j
    strided()
    ok = all(bool((out[:, j * w:(j + 1) * w] == i * p + j).all()) for i, out in enumerate(rows) for j in range(p))
    res["ok"] = ok
    print("LOCALCOPY " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
