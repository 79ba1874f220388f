# pfl-research (apple/pfl-research) 0.6.0: Python 3.10-3.12, so Python 3.11 and the local torch
# 2.13.0 CPU wheel (no CUDA download). Its multi-worker simulation needs no extra package: torchrun
# and torch.distributed's gloo backend come with torch.
make_venv 3.11
pip_install "torch==2.13.0" "pfl==0.6.0"
smoke_import "import torch, pfl, peer_common; from pfl.algorithm import FederatedAveraging, NNAlgorithmParams; from pfl.model.pytorch import PyTorchModel; from pfl.aggregate.simulate import SimulatedBackend; from pfl.aggregate.weighting import WeightByDatapoints"
write_ready pfl torch numpy
