"""nvmath 1.0's Redistribute between Slab distributions, here on CPU processes (MPI).

A 3-D array split along X (``Slab.X``) is redistributed to be split along Y (``Slab.Y``): each process passes
only its own slab; the global shape is inferred from the operands. Any number of processes:

    mpiexec -n 3 python examples/redistribute_slabs.py
"""

import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas.distribution import Redistribute, Slab

communicator = MPI.COMM_WORLD
dask_pgas.initialize(None, communicator, backends=["mpi"])
rank, nranks = communicator.Get_rank(), communicator.Get_size()

global_shape = (10, 7, 3)
# This process's slab of the global array arange(210).reshape(10, 7, 3), split along X.
whole = np.arange(np.prod(global_shape), dtype=np.float64).reshape(global_shape)
slab_x = Slab.X.box(rank, nranks, global_shape)
a = np.ascontiguousarray(whole[slab_x.lower[0]:slab_x.upper[0]])
assert a.shape == Slab.X.shape(rank, global_shape)

with Redistribute(a, Slab.X, Slab.Y) as r:
    r.plan()
    b = r.execute()  # this process's slab along Y, as a new NumPy array

slab_y = Slab.Y.box(rank, nranks, global_shape)
assert np.array_equal(b, whole[:, slab_y.lower[1]:slab_y.upper[1]])
print(f"[{rank}] X slab {a.shape} -> Y slab {b.shape}: checked")
dask_pgas.finalize()
