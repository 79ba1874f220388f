# FedLab 1.3.0 (an sdist of 2022, its last release), Python 3.11. FedLab imports torchvision at
# import time (fedlab.core -> fedlab.contrib.dataset), and PyPI's torchvision 0.28.0 (the release
# for torch 2.13.0) is built against PyPI's CUDA torch: beside the local torch 2.13.0+cpu wheel
# its C extension does not load and `import torchvision` fails ("operator torchvision::nms does not
# exist"). So this env takes PyPI's torch 2.13.0 (the CUDA build, pulling the nvidia-* wheels):
# `torch===2.13.0` (exact) keeps pip from choosing the local +cpu wheel.
make_venv 3.11
pip_install "torch===2.13.0" "torchvision==0.28.0" "fedlab==1.3.0"
smoke_import "import torch, torchvision, fedlab, peer_common; from fedlab.contrib.algorithm.basic_client import SGDSerialClientTrainer; from fedlab.contrib.algorithm.basic_server import SyncServerHandler; from fedlab.core.standalone import StandalonePipeline"
write_ready fedlab torch torchvision numpy
