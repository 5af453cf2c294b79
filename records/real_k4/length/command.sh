# The length experiments of records/issue17_real_model.md ("Answers that grow to the
# cap"): the sharper variant's recorded seeds rerun with the current code and one setting
# changed, from a fixed checkout (a git worktree) with PYTHONPATH pointing at it, one thread
# each: the floor and cut-answer arms at 11b6305, the stop-token arm at ae98d00 (resumed at
# f45ae42 and c4bf7f5, which change no training code; the JS rerun at 76c67b0). Resumable:
# rerun a line as it is.
R=runs/real-k4/constraints-real-start_phrase-keyword_include-end_phrase-letter_frequency
S=records/scripts/rerun_config.py
# the cancellation floor only (the fix of ca11cf6); stopped at 25 / 24 steps, identical to the records
python $S $R/mrtpo-specific-gamma2-seed0 runs/real-k4-trunc/sharper-floor-seed0 --steps 45
python $S $R/mrtpo-specific-gamma2-seed1 runs/real-k4-trunc/sharper-floor-seed1 --steps 45
# cut answers take GDPO's broadcast
python $S $R/mrtpo-specific-gamma2-seed0 runs/real-k4-trunc/sharper-cutuniform-seed0 --steps 45 --set truncated_credit=uniform
python $S $R/mrtpo-specific-gamma2-seed1 runs/real-k4-trunc/sharper-cutuniform-seed1 --steps 45 --set truncated_credit=uniform
# the stop token takes weight 1 for every reward
for s in 0 1 2; do
  python $S $R/mrtpo-specific-gamma2-seed$s runs/real-k4-trunc/sharper-stopuniform-seed$s --steps 100 --set stop_credit=uniform
done
# the paper's JS form, seed 2, with the floor (stopped at 31 steps)
python $S $R/mrtpo-seed2 runs/real-k4-floor/mrtpo-seed2 --steps 100
