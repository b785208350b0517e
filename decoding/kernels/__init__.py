"""The kernels: the arithmetic of one model step — repacking stored weights into the layouts the
kernels stream best (`repack`), the int8 VNNI dot products (`vnni`, `fast_kernels`) and the exact
float32 ones (`kernels`), small numeric helpers (`numeric`), the whole transformer step as one run on
the thread pool (`forward`), and the plain numpy forward pass the others are tested against
(`reference`).

Kernels import the model (its config, storage types and weights) and kvcache/threadpool, never the
engine.
"""
