# K = 4 rewards on SmolLM2-135M-Instruct, 3 seeds x 100 steps (issue 17). Run from a fixed
# checkout of the commit in the record (compare keys reuse by a hash of the sources), with
# runs/ pointing at the main checkout's runs/; the command is resumable: rerun it as it is.
git worktree add /work/wt17b a303fe0 && cp mrtpo_kernels/_C*.so /work/wt17b/mrtpo_kernels/
ln -s "$PWD/runs" /work/wt17b/runs && ln -s "$PWD/.venv" /work/wt17b/.venv
cd /work/wt17b && OMP_NUM_THREADS=1 .venv/bin/python -m mrtpo compare \
  --task constraints-real:start_phrase,keyword_include,end_phrase,letter_frequency \
  --model smollm2-135m-instruct --warm-steps 30 --warm-noise 0.6 --autocast bfloat16 \
  --algos gdpo,mrtpo --seeds 3 --steps 100 --prompts-per-step 2 --group-size 4 \
  --max-new-tokens 32 --micro-batch 8 --lr 2e-5 --target 0.3 --jobs 2 --threads 1 \
  --no-baseline-replay --checkpoint-every 5 --out runs/real-k4 --results runs/real-k4-results
# the fourth kind's calibration (warm start as above, 16 prompts x 4 samples):
OMP_NUM_THREADS=1 .venv/bin/python docs/results/scripts/real_calibration.py \
  --task constraints-real:start_phrase,keyword_include,end_phrase,letter_frequency \
  --warm-steps 30 --warm-noise 0.6 --prompts 16 --group 4 --max-new-tokens 32
