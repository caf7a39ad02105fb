# Sourced by bench/gpu.sh on the device machine (its setup, before each subcommand): installs the carried
# cp312 wheels (.whl/: pyopencl and what clgpt imports) into /tmp/site and points the OpenCL loader at NVIDIA's
# library through an ICD file of our own (the image registers none). Run from the repository root (carry .whl),
# or from a worktree under .wt/ (the wheels two folders up), or set WHL to the wheels' folder.
W=${WHL:-.whl}
[ -d "$W" ] || W=../../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
mkdir -p /tmp/icd && echo /usr/lib/libnvidia-opencl.so.1 >/tmp/icd/nvidia.icd && export OCL_ICD_VENDORS=/tmp/icd
[ -e /usr/lib/libnvidia-opencl.so.1 ] || echo /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1 >/tmp/icd/nvidia.icd

# The bench shapes (`clgpt bench` and bench/bench_torch.py arguments): M (4.3 M parameters), M6 (the 6-layer,
# 384-channel, batch-64, context-256 shape of nanoGPT's character recipe, vocabulary 4096), L (92 M)
M="--vocab 4096 --ctx 256 --embd 256 --ffn 1024 --heads 4 --layers 4 --batch 8"
M6="--vocab 4096 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64"
L="--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16"
# issue 30's shapes: the character recipe (vocabulary 260) and GPT-2 small and medium (vocabulary 50304), each as
# gpt2 and as llama (SwiGLU width 2/3 of 4C, as llama sizes it), and the character recipe with 4 experts, 2 used
CHAR="--vocab 260 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64"
CHAR_L="--arch llama --vocab 260 --ctx 256 --embd 384 --ffn 1024 --heads 6 --layers 6 --batch 64"
CHAR_MOE="$CHAR_L --experts 4 --experts-used 2"
GPT2S="--vocab 50304 --ctx 1024 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 8"
GPT2S_L="--arch llama --vocab 50304 --ctx 1024 --embd 768 --ffn 2048 --heads 12 --layers 12 --batch 8"
GPT2M="--vocab 50304 --ctx 1024 --embd 1024 --ffn 4096 --heads 16 --layers 24 --batch 8"
GPT2M_L="--arch llama --vocab 50304 --ctx 1024 --embd 1024 --ffn 2816 --heads 16 --layers 24 --batch 8"

# clgpt_train LABEL ARGS STEPS [PRECISION]: `clgpt bench` at PRECISION (bf16 unless given; other settings from the
# caller's environment, CLGPT_SIDE added to the label), its train: and memory: lines into $O/train.txt;
# torch_peer LABEL ARGS STEPS: PyTorch as nanoGPT runs it on a GPU (torch.compile, bf16 autocast, SDPA, fused AdamW),
# its train: line; torch_eager LABEL ARGS STEPS: PyTorch CUDA eager fp32 (SDPA, fused AdamW), its train: line
clgpt_train() {
  echo "== $1 clgpt ${4:-bf16} ${CLGPT_SIDE:-}" | tee -a $O/train.txt
  timeout 100 python3 -m clgpt bench $2 --steps $3 --gemm 0 --precision ${4:-bf16} 2>&1 | grep "train:\|memory:" | tee -a $O/train.txt
}
torch_peer() {
  echo "== $1 torch nanogpt (compile, bf16 autocast, SDPA, fused AdamW)" | tee -a $O/train.txt
  timeout 120 python3 bench/bench_torch.py $2 --steps $3 --warmup 5 --device cuda --nanogpt 2>&1 | grep "train:" | tee -a $O/train.txt
}
torch_eager() {
  echo "== $1 torch cuda eager fp32" | tee -a $O/train.txt
  timeout 120 python3 bench/bench_torch.py $2 --steps $3 --device cuda 2>&1 | grep "train:" | tee -a $O/train.txt
}

# profile LABEL ARGS [PRECISION]: per-kernel device times (CLGPT_BENCH_PROFILE) of `clgpt bench` at PRECISION (bf16
# unless given) into $O/profile.txt; profile_bf16 SHAPE...: that at each shape, its arguments in the caller's
# variable of that name (bench/gpu.sh flash's PROFILE="M6 L")
profile() {
  echo "== $1 profile" | tee -a $O/profile.txt
  CLGPT_BENCH_PROFILE=1 timeout 90 python3 -m clgpt bench $2 --steps 3 --gemm 0 --precision ${3:-bf16} 2>&1 \
    | grep -A60 "^profile" | tee -a $O/profile.txt
}
profile_bf16() {
  for shape in "$@"; do
    eval args=\$$shape
    profile $shape "$args"
  done
}
