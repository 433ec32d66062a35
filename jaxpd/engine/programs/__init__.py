"""The jitted programs a mesh runs and what they read: the decode and prefill runners,
attention kernels placed on a mesh, sampling and penalties, expert parallelism, and
params placed in the layout the programs read."""
