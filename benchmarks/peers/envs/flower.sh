# Flower 1.42.0 with its simulation engine (flwr[simulation] pins ray 2.55.1), Python 3.11,
# torch 2.13.0 CPU (the local CPU wheel is built for Python 3.11).
make_venv 3.11
pip_install "torch==2.13.0" "numpy<3" "flwr[simulation]==1.42.0"
smoke_import "import flwr, ray, torch, numpy, peer_common; from flwr.simulation import run_simulation; from flwr.server.strategy import FedAvg, FedAdam, FedYogi"
write_ready flwr ray torch numpy
