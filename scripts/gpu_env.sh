# Sourced by the scripts that run plora on a lent GPU machine (scripts/gpu_tier.sh,
# scripts/gpu_sweep2.sh): NCCL without NVLink multicast, no network, Ray's and plora's extras
# from .device/site.tar.xz when carried (../shared/tools/device-site.sh builds it), and plora on
# the path as a copy of the package (plora/ with kernels/ as plora/kernels): never the
# repository root, whose kernels/ would shadow the PyPI package transformers looks for.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
ROOT=$(pwd)
OUT=${OUT:-/tmp/plora-out}
mkdir -p "$OUT" /tmp/plora-pkg /tmp/plora-site
if [ -f .device/site.tar.xz ] && [ ! -e /tmp/plora-site/.unpacked ]; then
  tar -xJf .device/site.tar.xz -C /tmp/plora-site && touch /tmp/plora-site/.unpacked
fi
rm -rf /tmp/plora-pkg/plora && cp -r plora /tmp/plora-pkg/plora && cp -r kernels /tmp/plora-pkg/plora/kernels
export PYTHONPATH=/tmp/plora-pkg:/tmp/plora-site
export PATH=/tmp/plora-site/bin:$PATH
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
  python3 -c 'import ray; print("ray", ray.__version__)' 2>&1 | tail -1
  python3 -c 'import liger_kernel; print("liger-kernel present")' 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
