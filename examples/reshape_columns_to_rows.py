"""The nvmath.distributed reshape example, with ``nvmath.distributed`` replaced by ``dask_pgas``.

A 4x4 matrix distributed by columns on two processes is redistributed by rows.

    mpiexec -n 2 python examples/reshape_columns_to_rows.py
"""

import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas.distribution import Box

communicator = MPI.COMM_WORLD
if communicator.Get_size() != 2:  # (not in nvmath's example: its boxes are for two processes)
    # (the message once, from rank 0; every rank exits with status 1)
    raise SystemExit(f"this example runs on 2 processes: mpiexec -n 2 python {__file__}"
                     if communicator.Get_rank() == 0 else 1)
dask_pgas.initialize(None, communicator, backends=["mpi"])

# The global dimensions of the matrix are 4x4. The matrix is distributed
# column-wise, so each process has 4 rows and 2 columns.
rank = communicator.Get_rank()

# Initialize the matrix on each process, as a NumPy ndarray (on the CPU).
A = np.zeros((4, 2)) if rank == 0 else np.ones((4, 2))

# Reshape from column-wise to row-wise.
if rank == 0:
    input_box = Box((0, 0), (4, 2))
    output_box = Box((0, 0), (2, 4))
else:
    input_box = Box((0, 2), (4, 4))
    output_box = Box((2, 0), (4, 4))

# Distributed reshape returns a new operand with its own buffer.
B = dask_pgas.reshape.reshape(A, input_box, output_box)

# The result is a NumPy ndarray, distributed row-wise:
# [0] B:
# [[0. 0. 1. 1.]
#  [0. 0. 1. 1.]]
#
# [1] B:
# [[0. 0. 1. 1.]
#  [0. 0. 1. 1.]]
print(f"[{rank}] B:\n{B}")

dask_pgas.finalize()
