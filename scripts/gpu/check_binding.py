"""Which GPU each PE took, and whether ``bootstrap`` warned, on 2 ``LocalMPICluster(gpus=1)`` workers and on 2
``LocalCluster`` workers (unique-id bring-up). Each worker sees one GPU, so no warning is expected. Then 2
``LocalMPICluster(gpus=1)`` workers under the launcher's own ``CUDA_VISIBLE_DEVICES`` (GPU 0's UUID). One line
per cluster, starting with BIND."""

import warnings

from distributed import Client, LocalCluster

import dask_pgas


def main() -> None:
    clusters = {
        "LocalMPICluster": lambda: dask_pgas.LocalMPICluster(n_workers=2, gpus=1, backends=["nvshmem"]),
        "LocalCluster": lambda: LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None),
    }
    for kind, make in clusters.items():
        with make() as cluster, Client(cluster) as client, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            world = dask_pgas.bootstrap(client, backends=["nvshmem"])
            ours = [str(w.message) for w in caught if "dask_pgas" in str(w.message)]
            info = dask_pgas.world(client, detail=True).info.values()  # each PE's report
            gpus = sorted((i["gpu"], i["visible_gpus"]) for i in info)
            print(f"BIND {kind}: {world.npes} PEs, GPU and visible count per worker {gpus}, warnings {ours}",
                  flush=True)
            dask_pgas.teardown(client)
    masked()


def masked() -> None:
    """LocalMPICluster(gpus=1) under the launcher's own mask (the GPU's UUID): each worker must keep that entry,
    not GPU 0 of the machine (d527bee)."""
    import os
    import subprocess

    try:
        uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"BIND masked: skipped, no nvidia-smi ({exc})", flush=True)
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    try:
        with dask_pgas.LocalMPICluster(n_workers=2, gpus=1, backends=["nvshmem"]) as cluster, \
                Client(cluster) as client:
            seen = sorted(client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES")).values())
            print(f"BIND masked: launcher mask {uuid}, workers' masks {seen}, "
                  f"{'OK' if seen == [uuid, uuid] else 'WRONG'}", flush=True)
            dask_pgas.teardown(client)
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]


if __name__ == "__main__":  # (LocalCluster spawns its workers: they import this module)
    main()
