"""areal-hpc: fully asynchronous RL for large reasoning models, native to Slurm.

torch, vLLM and megatron-core come in device-specific builds (CPU or CUDA); tools/setup.sh chooses
and installs them before this package. See README.md.
"""

from setuptools import find_packages, setup

setup(
    name="areal-hpc",
    version="0.1.0",
    description="Fully asynchronous RL for large reasoning models on Slurm clusters",
    python_requires=">=3.11",
    packages=find_packages(include=["areal_hpc", "areal_hpc.*"]),
    package_data={"areal_hpc.launch": ["templates/*.sbatch"]},
    install_requires=[
        "torch>=2.13",
        "megatron-core==0.16.1",
        "transformers",
        "tokenizers",
        "safetensors",
        "numpy",
        "omegaconf>=2.3",
        "mpi4py>=4",
        "submitit==1.5.4",
        "tensorboard",
        "wandb==0.31.0",  # logging.wandb: areal_hpc.wandb_log reads its credentials, the tests its offline files
        "math-verify",
        "peft==0.21.2",  # the format of an exported LoRA adapter (areal_hpc.trainer.export: its adapter_config.json)
        "datasets",  # data sets saved with save_to_disk, and parquet (pyarrow) for areal_hpc.data.dataset
        "pyyaml",
        "psutil",  # areal_hpc.network: the node's interfaces (vLLM needs it too)
        "matplotlib",  # tools/plot_run.py
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff"],
        "bench": ["trl"],
    },
    entry_points={"console_scripts": ["areal-hpc = areal_hpc.cli:main"]},
)
