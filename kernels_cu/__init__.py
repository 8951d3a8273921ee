"""How fllama runs fast on a GPU: .cu kernels with their launchers and torch references, the PyCUDA build
layer (build.py) and the engine. Importing this package never imports pycuda."""
