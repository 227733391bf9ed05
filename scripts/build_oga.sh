#!/usr/bin/env bash
# Build onnxruntime-genai's model directories of Hugging Face models, for `rlxrt bench --oga-target/--oga-draft`.
# Its model builder needs transformers >= 5, which rlxrt's [export] extra (optimum-onnx: transformers < 4.58)
# cannot share a venv with, so it runs in a venv of its own (made once, VENV, default ./.oga-venv).
#   usage: scripts/build_oga.sh HF_DIR OUT_DIR [HF_DIR OUT_DIR ...]
#   PRECISION=int4 (default fp32) builds its int4 graph, computed with int8 activations (int4_accuracy_level=4)
# Then, in rlxrt's own venv: pip install onnxruntime-genai (it brings onnxruntime; keep only one ORT build)
#   rlxrt bench --target T --draft D --oga-target OUT_T --oga-draft OUT_D
set -euo pipefail
[ $# -ge 2 ] && [ $(( $# % 2 )) -eq 0 ] || { sed -n 2,9p "$0"; exit 2; }
VENV=${VENV:-.oga-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0   # the CPU wheel; a bare torch pulls a CUDA build
  "$VENV/bin/python" -m pip install -q "transformers>=5" onnx-ir onnxscript onnxruntime-genai
fi
precision=${PRECISION:-fp32}
extra=()
if [ "$precision" = int4 ]; then extra=(--extra_options int4_accuracy_level=4); fi
while [ $# -gt 0 ]; do
  src=$1 out=$2; shift 2
  cache=$(mktemp -d)
  "$VENV/bin/python" -m onnxruntime_genai.models.builder -i "$src" -o "$out" -p "$precision" -e cpu -c "$cache" \
    ${extra[@]+"${extra[@]}"}
  rm -rf "$cache"
  echo "built $out from $src"
done
