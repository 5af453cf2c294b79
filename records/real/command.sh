# run from a fixed checkout of the commit in the record (compare keys reuse by a hash of the sources)
OMP_NUM_THREADS=1 .venv/bin/python -m mrtpo compare --task constraints-real \
  --model smollm2-135m-instruct --warm-steps 30 --warm-noise 0.6 --autocast bfloat16 \
  --algos gdpo,mrtpo --seeds 3 --steps 40 --prompts-per-step 2 --group-size 4 \
  --max-new-tokens 32 --micro-batch 8 --lr 2e-5 --target 0.4 --jobs 2 --threads 1 \
  --no-baseline-replay --checkpoint-every 5 --out runs/real40 --results runs/real40-results
