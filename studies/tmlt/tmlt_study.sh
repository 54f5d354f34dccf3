#!/usr/bin/env bash
# The timestep-encoding study (studies/tmlt/README.md): every sweep it reports, in order. Each stage is a
# `loopformer sweep`, so re-running this script completes an interrupted study (finished runs are skipped,
# interrupted ones resume). Runs go to $STUDY (default sweeps/tmlt, ignored by git); `collect` copies the compact
# results (tables, plots, every run's results.json and dynamics records; the records are not committed) into
# studies/tmlt/.
#
#   bash studies/tmlt/tmlt_study.sh screen      # stage 1: TMLT recipes on ED-6 at r = 16, seed 0 (5 runs)
#   bash studies/tmlt/tmlt_study.sh ed16        # stage 2: looped vs TMLT (default recipe), ED-6, r = 16, seeds 0-2
#   bash studies/tmlt/tmlt_study.sh lcs16       # stage 3: the same on LCS-8
#   bash studies/tmlt/tmlt_study.sh icl         # stage 4: looped vs TMLT on in-context decision trees, r = 4, seeds 0-2
#   bash studies/tmlt/tmlt_study.sh ed32 lcs32  # stage 5: r = 32
#   bash studies/tmlt/tmlt_study.sh last        # stage 6: the loss on the last loop only (the paper's), ED-6, r = 16
#   bash studies/tmlt/tmlt_study.sh last-paper  #          ... TMLT with the paper's parametrisation, seed 0
#   bash studies/tmlt/tmlt_study.sh last-lr1    #          ... TMLT with the timestep parameters at the full lr, seed 0
#   bash studies/tmlt/tmlt_study.sh embed       # stage 7: the loop-index features: learned per loop, or PE(50 t), seed 0
#   bash studies/tmlt/tmlt_study.sh lcs16-last ed32-last lcs32-last  # stage 8: the last-loop loss on LCS-8 and at r = 32
#   bash studies/tmlt/tmlt_study.sh candidates  # stage 9: the remaining recipe candidates under the last-loop loss, seed 0:
#                                          #   timestep weight decay, PE(t / r), a loss window, a loop curriculum,
#                                          #   the paper's schedule (lr 1e-4, linear decay; also alone: paper-schedule)
#   bash studies/tmlt/tmlt_study.sh ed32-grad lcs32-grad  # stage 10: r = 32 with backpropagation through the last 16 loops
#   bash studies/tmlt/tmlt_study.sh window      # stage 11: the loss over the last 4 loops, ED-6, r = 16, seeds 0-2 (seed 0
#                                          #   is also a run of the candidates stage)
#   bash studies/tmlt/tmlt_study.sh lcs16-window  # stage 12: the loss window on LCS-8, r = 16, seeds 0-2
#   bash studies/tmlt/tmlt_study.sh ed32-window lcs32-window  # stage 13: the loss window at r = 32 (all loops in the graph)
#   bash studies/tmlt/tmlt_study.sh curriculum  # stage 14: the loop curriculum over seeds 0-2 (seed 0 is also a candidates run)
# The last-loop stages cost about half an every-loop stage (8-9 min per r = 16 run on one free core).
#   bash studies/tmlt/tmlt_study.sh ablations   # the TMLTs with the loop index removed / without modulation (studies/tmlt/README.md 8)
#   bash studies/tmlt/tmlt_study.sh collect     # tables and compact results into studies/tmlt/
# Cost on 2 CPU cores (two runs at a time, one thread each): about 16 min per run at r = 16, 30 min at r = 32.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/tmlt}
. scripts/study_lib.sh

# looped vs TMLT (default recipe), seeds 0-2, same data: pair TASK R OUT [override ...], loop-wise up to 2r
pair() {
  "$LF" sweep "configs/cpu/$1.yaml" model.loops="$2" eval.max_loops=$(($2 * 2)) "${@:4}" \
    --grid seed=0,1,2 model.timestep=false,true --out "$STUDY/$3" "${SW[@]}"
}

stage() {
  case "$1" in
    screen)
      # stage 1 ran before the paired initialisation (see studies/tmlt/README.md); re-running it now re-draws the
      # initial weights
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 model.timestep=true eval.max_loops=32 \
        --grid model.timestep_gate_init=0,1 train.timestep_lr_mult=1,0.1 --baseline model.timestep=false \
        --out "$STUDY/screen-ed16" "${SW[@]}" ;;
    ed16)
      pair ed 16 ed16 ;;
    lcs16)
      pair lcs 16 lcs16 ;;
    icl)
      "$LF" sweep configs/cpu/icl.yaml \
        --grid seed=0,1,2 model.timestep=false,true --out "$STUDY/icl" "${SW[@]}" ;;
    ed32)
      pair ed 32 ed32 ;;
    lcs32)
      pair lcs 32 lcs32 ;;
    paper)
      # the paper's parametrisation beside the default, same data and budget (ED-6, r = 16, seeds 0-2)
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 model.timestep=true eval.max_loops=32 "${PAPER[@]}" \
        --grid seed=0,1,2 --out "$STUDY/ed16-paper" "${SW[@]}" ;;
    last)
      pair ed 16 ed16-last train.loss_loops=last ;;
    lcs16-last)
      pair lcs 16 lcs16-last train.loss_loops=last ;;
    ed32-last)
      pair ed 32 ed32-last train.loss_loops=last ;;
    lcs32-last)
      pair lcs 32 lcs32-last train.loss_loops=last ;;
    last-paper)
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=last model.timestep=true \
        "${PAPER[@]}" --grid seed=0 --out "$STUDY/ed16-last-paper" "${SW[@]}" ;;
    last-lr1)
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=last model.timestep=true \
        train.timestep_lr_mult=1 --grid seed=0 --out "$STUDY/ed16-last-lr1" "${SW[@]}" ;;
    embed)
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 model.timestep=true \
        --grid model.timestep_embed=learned --baseline model.timestep_scale=50 --out "$STUDY/ed16-embed" "${SW[@]}" ;;
    candidates)
      # TMLT-only changes (against the seed-0 TMLT of stage `last`) and changes to training (paired with a looped run)
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=last model.timestep=true \
        --grid train.timestep_weight_decay=0,0.1 --baseline model.timestep_scale=0.0625 \
        --out "$STUDY/ed16-cand-ts" "${SW[@]}"
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=window train.loss_window=4 \
        --grid model.timestep=false,true --out "$STUDY/ed16-cand-window" "${SW[@]}"
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=last \
        train.loops_start=4 train.loops_every=300 train.loops_increment=2 \
        --grid model.timestep=false,true --out "$STUDY/ed16-cand-curriculum" "${SW[@]}"
      stage paper-schedule ;;
    paper-schedule)
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=last \
        train.lr=1e-4 train.schedule=linear train.warmup_fraction=0 \
        --grid model.timestep=false,true --out "$STUDY/ed16-cand-paper-schedule" "${SW[@]}" ;;
    window)
      # seed 0 is the candidates stage's window pair (the same command); copy its two run folders into
      # ed16-window/runs/seed=0_timestep=false|true to skip re-running them
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=window train.loss_window=4 \
        --grid seed=0,1,2 model.timestep=false,true --out "$STUDY/ed16-window" "${SW[@]}" ;;
    curriculum)
      # seed 0 is the candidates stage's curriculum pair (the same command); copy its two run folders into
      # ed16-curriculum/runs/seed=0_timestep=false|true to skip re-running them
      "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=32 train.loss_loops=last \
        train.loops_start=4 train.loops_every=300 train.loops_increment=2 \
        --grid seed=0,1,2 model.timestep=false,true --out "$STUDY/ed16-curriculum" "${SW[@]}" ;;
    lcs16-window)
      pair lcs 16 lcs16-window train.loss_loops=window train.loss_window=4 ;;
    ed32-window)
      pair ed 32 ed32-window train.loss_loops=window train.loss_window=4 ;;
    lcs32-window)
      pair lcs 32 lcs32-window train.loss_loops=window train.loss_window=4 ;;
    ed32-grad)
      pair ed 32 ed32-grad train.loss_loops=last model.grad_loops=16 ;;
    lcs32-grad)
      pair lcs 32 lcs32-grad train.loss_loops=last model.grad_loops=16 ;;
    ablations)
      ablate studies/tmlt ed16 ed16-last lcs16-last ed16-window lcs16-window ed32-last ed32-window ed16-curriculum ;;
    collect)
      collect studies/tmlt ;;
    *) echo "unknown stage: $1" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,27p' "$0"; exit 2; }
for s in "$@"; do stage "$s"; done
