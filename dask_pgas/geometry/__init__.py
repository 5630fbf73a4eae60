"""Pure geometry: boxes, tilings and chunk grids. Imports no MPI, CUDA or distributed code."""
