"""zoo: export robot policies to verified ExecuTorch CUDA artifacts.

The core (rewrites, lowering, verification, audit, publishing) imports only torch, executorch and small
libraries, and keeps to Python 3.10 syntax so it also runs under a Jetson's JetPack Python. lerobot is
imported only inside ``zoo.policies.<family>`` modules, when an export unit is built.
"""

__version__ = "0.1.0"
