"""Process and compiler settings: malloc tuning for XLA:CPU (a process re-executes itself with
it) and the XLA options a training step is compiled with. Kernels stay in :mod:`jctr.ops`."""
