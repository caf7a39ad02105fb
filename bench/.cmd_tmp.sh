source bench/gpu_env.sh; export PYOPENCL_CTX=0; O=$OUT
FLASH_VARIANTS="0,0;0,128;0,168;1,0;1,168" timeout 200 python3 bench/flash_check.py 2>&1 | grep -v "Warn\|lambda\|^$" | tee $O/flash.txt
M6="--vocab 4096 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64"
L="--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16"
for shape in M6 L; do eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  for r in 0 128; do echo "== $shape flash regs $r"; CLGPT_FLASH_REGS=$r timeout 60 python3 -m clgpt bench $args --steps $steps --gemm 0 --precision bf16 2>&1 | grep "train:"; done
  echo "== $shape torch"; timeout 120 python3 bench/bench_torch.py $args --steps $steps --warmup 5 --device cuda --nanogpt 2>&1 | grep "train:"
done | tee $O/train.txt
