#!/usr/bin/env bash
# The accelerator benchmark as one command (benchmarks/accelerator.py says what it measures):
#
#   bash benchmarks/accelerator.sh                   # full sizes on the chip present
#   bash benchmarks/accelerator.sh --quick           # tiny shapes, CPU too
#   bash benchmarks/accelerator.sh --json r.json --markdown r.md
#
# It installs only what is missing, so it runs offline on a machine that already has jax (with
# its GPU plugin), flax, optax and orbax, as the rented H200 image does. This checkout's tfx is
# used through PYTHONPATH, installed or not. PYTHON picks the interpreter (default python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
export PYTHONPATH="$root:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
    && ! "$python" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null
then
  echo "accelerator.sh: a GPU is present but jax does not use it: installing jax[cuda12]" >&2
  "$python" -m pip install -q -U "jax[cuda12]"
fi
if ! "$python" -c "import accelerator" >/dev/null 2>&1; then
  if [ -d "$root/.whl" ]; then  # an offline machine: wheels carried in the checkout's .whl/
    echo "accelerator.sh: installing the wheels in $root/.whl" >&2
    "$python" -m pip install -q --no-index --no-deps "$root"/.whl/*.whl
  else
    echo "accelerator.sh: installing tfx's dependencies (pip install -e $root)" >&2
    "$python" -m pip install -q -e "$root"
  fi
fi
exec "$python" "$root/benchmarks/accelerator.py" "$@"
