# BlazeFL: 3.0.0 is not on the package index here; the newest served, 3.0.0a1, needs Python >= 3.13
# (2.0.3 needs >= 3.12), so Python 3.13. No torch 2.13.0 CPU wheel exists for 3.13 here, and PyPI
# serves no CPU-only Linux torch: its torch 2.13.0 for cp313 is the CUDA build, which pulls the
# nvidia-* wheels (measured here: 126 s, 4.7 GB venv, against 1.1 GB for a CPU-wheel env). The
# CUDA build runs on a CPU-only machine unchanged. (BlazeFL's multi-threaded mode is documented for
# free-threaded Python 3.14t; pyenv here has no free-threaded build, so it runs with the GIL.)
make_venv 3.13
pip_install "torch==2.13.0" "blazefl[contrib,reproducibility]==3.0.0a1"
smoke_import "import torch, peer_common; from blazefl.contrib import FedAvgBaseClientTrainer, FedAvgBaseServerHandler, FedAvgProcessPoolClientTrainer, FedAvgThreadPoolClientTrainer"
write_ready blazefl torch numpy
