#!/usr/bin/env bash
# The stability study (studies/stability/README.md): do deep loops train on every seed and settle past r? Each stage is a
# `loopformer sweep` of the shipped depth configs, so re-running this script completes an interrupted study
# (finished runs are skipped, interrupted ones resume). Runs go to $STUDY (default sweeps/stability, ignored by
# git); `collect` copies the compact results (tables, every run's results.json and dynamics records; the records are
# not committed) into studies/stability/. Every run is evaluated after every loop up to 4r (eval.max_loops), so
# accuracy at r, 2r and 4r and the drift past r come from the same run.
#
#   bash studies/stability/stability_study.sh baseline-schedule  # the circuit (K = 32) at r = 32 with the plain recipe (the
#                                                      #   config's earlier default): looped and TMLT, seeds 0-4
#                                                      #   (10 runs of 2,000 steps)
#   bash studies/stability/stability_study.sh default-schedule   # ... with the config's default now (state noise, 4,000
#                                                      #   steps, spike skipping, best weights), seeds $SEEDS
#   bash studies/stability/stability_study.sh baseline-pointer   # pointer chasing (16 symbols, 12 hops) at r = 32 with the
#                                                      #   shipped recipe: looped and TMLT, seeds 0-4 (10 runs of
#                                                      #   4,000 steps, ~15 min each on one core)
#   bash studies/stability/stability_study.sh screen-pointer     # each stabiliser alone on pointer chasing at r = 32, looped,
#   bash studies/stability/stability_study.sh screen-schedule    #   seeds 0-1 (SCREENS below; ~17 min / ~8 min a run);
#                                                      #   SCREEN_SEEDS=1 ONLY="recipe sandwich": some of them;
#                                                      #   SCREEN_EXTRA=model.timestep=true SCREEN_TAG=-tmlt: TMLT
#   bash studies/stability/stability_study.sh confirm-schedule   # the combination CONFIRM (below) on the circuit, looped
#   bash studies/stability/stability_study.sh confirm-pointer    #   and TMLT, seeds 0-4, paired with the baseline
#   bash studies/stability/stability_study.sh settle-schedule    # the circuit's TMLT recipe as shipped, end to end
#                                                      #   (configs/cpu/schedule-settle.yaml: learn, then the
#                                                      #   loops past r's own parameters alone), seeds 0-4
#   bash studies/stability/stability_study.sh hold-own-schedule  # the recipe's hold stages alone
#                                                      #   (configs/cpu/schedule-hold-own.yaml) from the first stages
#                                                      #   of the tenth round: $FIRST/seed=S (links to those runs)
#   bash studies/stability/stability_study.sh still-schedule     # its fifth stage alone, from settle-schedule's runs
#   bash studies/stability/stability_study.sh lr-window-schedule # the config's default at lr 1e-3 and 4e-3 (2e-3: its
#                                                      #   own), looped, seed 0
#   bash studies/stability/stability_study.sh looped-hold-schedule  # the looped model's grown hold
#                                                      #   (studies/stability/looped-hold.yaml, every parameter
#                                                      #   trained, lr $LR, default 1e-4) from looped runs that
#                                                      #   solve the circuit: $FIRST/seed=S
#   bash studies/stability/stability_study.sh collect            # tables and compact results into studies/stability/
# Cost on 2 CPU cores: two runs at a time ($JOBS), one thread each.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/stability}
. scripts/study_lib.sh
SEEDS=${SEEDS:-0,1,2,3,4}

# the circuit's baseline and screens were run on its plain 2,000-step recipe (SCHEDULE_AS_RUN, scripts/study_lib.sh);
# the config's default is now the recipe this study found (thirteenth round)
as_run() { [ "$1" != schedule ] || echo "${SCHEDULE_AS_RUN[@]}"; }   # as_run CONFIG: its runs' overrides, unquoted

# the recipe of CONFIG at r = 32, looped and TMLT over $SEEDS (paired by seed): baseline CONFIG OUT [override ...]
baseline() {
  # shellcheck disable=SC2046
  "$LF" sweep "configs/cpu/$1.yaml" model.loops=32 eval.max_loops=128 $(as_run "$1") "${@:3}" \
    --grid seed="$SEEDS" model.timestep=false,true --out "$STUDY/$2" "${SW[@]}"
}

# pointer chasing's loop curriculum, now its config's default (12 loops, +2 every 200 steps; studies/stability/README.md)
SLOW="train.loops_start=12 train.loops_every=200 train.loops_increment=2"
# the screened stabilisers: name and overrides (docs/stability.md says what each is and its verdict)
SCREENS=(
  "recipe:"
  "noise-start:model.start_state=noise model.start_noise=1.0"
  "state-noise:model.state_noise=0.05"
  "scale-rsqrt:model.loop_scale=rsqrt"
  "scale-inv:model.loop_scale=inv"
  "layerscale:model.loop_scale=layerscale model.layerscale_init=0.1"
  "sandwich:model.sandwich_norm=true"
  "stablemax:train.loss=stablemax"
  "loop-sampling:train.loops_start=0 train.loops_sample=uniform train.loops_min=16 train.loops_max=48"
  "hold:train.loops_start=0 train.loops_sample=uniform train.loops_min=32 train.loops_max=48"
  "fixed-point-loss:train.fixed_point=0.1"
  "truncated-bptt:model.grad_loops=16"
  "grad-window:model.grad_window=1"
  "grad-window-4:model.grad_window=4"
  "curriculum:train.loops_start=4 train.loops_every=50 train.loops_increment=2"
  "jacobian:train.jacobian=0.1"
  "adam-b2:train.betas=[0.9,0.95]"
  "skip-spikes:train.skip_spikes=100"
  "skip-spikes-20:train.skip_spikes=20"
  "prefix-curriculum:train.loops_start=4 train.loops_every=50 train.loops_increment=2 train.curriculum_targets=prefix"
  "curriculum-stablemax:train.loops_start=4 train.loops_every=50 train.loops_increment=2 train.loss=stablemax"
  "lr-1e-3:train.lr=1e-3"
  "lr-5e-4:train.lr=5e-4"
  "lr-4e-3:train.lr=4e-3"
  "noise-long:model.state_noise=0.05 train.steps=4000 train.ema_decay=0.995"
  "noise-long-skip20:model.state_noise=0.05 train.steps=4000 train.ema_decay=0.995 train.skip_spikes=20"
  "noise-long-best:model.state_noise=0.05 train.steps=4000 train.ema_decay=0.995 train.keep_best=true task.n_val=500 train.eval_every=250"
  "noise-long-skip20-best:model.state_noise=0.05 train.steps=4000 train.ema_decay=0.995 train.skip_spikes=20 train.keep_best=true task.n_val=500 train.eval_every=250"
  "slow-curriculum:$SLOW"
  "slow-curriculum-best:$SLOW train.keep_best=true task.n_val=500 train.eval_every=250"
  "slow-curriculum-fp:$SLOW train.fixed_point=0.1 train.fixed_point_loops=4"
  "slow-curriculum-noise:$SLOW model.state_noise=0.05"
  "slow-curriculum-r64:model.loops=64 eval.max_loops=256 train.loops_start=12 train.loops_every=100 train.loops_increment=2"
  "slow-curriculum-hold:$SLOW train.loops_sample=uniform train.loops_min=32 train.loops_max=64"
  "slow-curriculum-hold-clamp:$SLOW train.loops_sample=uniform train.loops_min=32 train.loops_max=64 model.timestep_past=clamp"
  "slow-curriculum-hold-index:$SLOW train.loops_sample=uniform train.loops_min=32 train.loops_max=64 model.timestep_past=hold"
  "noise-long-hold-index:model.state_noise=0.05 train.steps=4000 train.ema_decay=0.995 train.loops_sample=uniform train.loops_min=32 train.loops_max=64 model.timestep_past=hold"
  "noise-long-hold-late:model.state_noise=0.05 train.steps=6000 train.ema_decay=0.995 train.loops_hold=2 train.loops_sample_from=4000 model.timestep_past=hold"
  "hold-4:train.loops_hold=4"
  "prefix-slow-hold:train.loops_start=4 train.loops_every=200 train.loops_increment=2 train.curriculum_targets=prefix train.loops_hold=2 train.steps=4000 model.timestep_past=clamp"
  "prefix-noise-hold:train.loops_start=4 train.loops_every=200 train.loops_increment=2 train.curriculum_targets=prefix model.state_noise=0.05 train.skip_spikes=20 train.ema_decay=0.995 train.loops_hold=2 train.steps=4000 model.timestep_past=clamp"
  "noise-skip20-best-3k:model.state_noise=0.05 train.skip_spikes=20 train.keep_best=true task.n_val=500 train.eval_every=250 train.steps=3000"
  "noise-skip20-best-4k:model.state_noise=0.05 train.skip_spikes=20 train.keep_best=true task.n_val=500 train.eval_every=250 train.steps=4000"
  "noise-skip20-best-hold:model.state_noise=0.05 train.skip_spikes=20 train.keep_best=true train.keep_best_depth=trained task.n_val=500 train.eval_every=250 train.steps=4500 train.loops_hold=2 train.loops_sample_from=3000 model.timestep_past=hold"
  "noise-long-skip20-best-hold:model.state_noise=0.05 train.steps=6000 train.ema_decay=0.995 train.skip_spikes=20 train.keep_best=true train.keep_best_depth=trained task.n_val=500 train.eval_every=250 train.loops_hold=2 train.loops_sample_from=4000 model.timestep_past=hold"
  "noise-skip20-best-hold-long:model.state_noise=0.05 train.skip_spikes=20 train.keep_best=true train.keep_best_depth=trained task.n_val=500 train.eval_every=250 train.steps=6000 train.loops_hold=2 train.loops_sample_from=3000 model.timestep_past=hold"
  "hold-ft:model.state_noise=0.05 train.skip_spikes=20 train.keep_best=true train.keep_best_depth=trained task.n_val=500 train.eval_every=250 train.steps=2000 train.lr=5e-4 train.loops_hold=2 model.timestep_past=hold"
  "hold-ft-4:model.state_noise=0.05 train.skip_spikes=20 train.keep_best=true train.keep_best_depth=trained task.n_val=500 train.eval_every=250 train.steps=2000 train.lr=5e-4 train.loops_hold=4 model.timestep_past=hold"
  "fixed-point-mode:model.solver=anderson model.solver_backward=phantom:4 task.loop_targets=false train.loss_loops=last train.loops_start=0"
  "noise-long-lr1e-3:model.state_noise=0.05 train.steps=4000 train.lr=1e-3 train.ema_decay=0.995"
)
# screen CONFIG: every entry of SCREENS ("recipe": the shipped recipe itself, on the same code and seeds) as its
# own sweep, looped, seeds $SCREEN_SEEDS (default 0,1); $ONLY: the entries to run (names, space-separated);
# $SCREEN_EXTRA: overrides for every entry (e.g. model.timestep=true), $SCREEN_TAG: a suffix of the sweeps' names
screen() {
  local entry name
  for entry in "${SCREENS[@]}"; do
    name=${entry%%:*}
    [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || continue
    # shellcheck disable=SC2046,SC2086
    "$LF" sweep "configs/cpu/$1.yaml" model.loops=32 eval.max_loops=128 $(as_run "$1") ${entry#*:} ${SCREEN_EXTRA:-} \
      --grid seed="${SCREEN_SEEDS:-0,1}" --out "$STUDY/screen-$1-$name${SCREEN_TAG:-}" "${SW[@]}"
  done
}

# the combination confirmed with 5 seeds: stablemax cross-entropy and state noise in training (each rescued failing
# seeds alone in the screens); confirm CONFIG: looped and TMLT over $SEEDS, as the baseline
CONFIRM=(train.loss=stablemax model.state_noise=0.05)
confirm() {
  baseline "$1" "confirm-$1" "${CONFIRM[@]}"
}

# the recipe's fifth stage (configs/cpu/schedule-settle.yaml, `still`) alone: from the four-stage runs' weights, the
# own parameters on draws to 4r with the fixed-point loss (the state, not only the read-out, held past R)
STILL=(train.loops_hold=4 train.steps=400 train.lr=1.0e-2 train.eval_every=100 train.skip_spikes=0
       train.timestep_lr_mult=1 train.keep_best=false train.fixed_point=0.1 train.fixed_point_loops=4
       model.timestep_past=own "train.freeze=[embedding,block,timestep,modulation,head]")

stage() {
  case "$1" in
    baseline-schedule) baseline schedule baseline-schedule ;;
    default-schedule)  "$LF" sweep configs/cpu/schedule.yaml eval.max_loops=128 --grid seed="$SEEDS" \
                         model.timestep=false,true --out "$STUDY/default-schedule" "${SW[@]}" ;;
    baseline-pointer)  baseline pointer baseline-pointer ;;
    screen-pointer)    screen pointer ;;
    screen-schedule)   screen schedule ;;
    confirm-schedule)  confirm schedule ;;
    confirm-pointer)   confirm pointer ;;
    hold-own-schedule) "$LF" sweep configs/cpu/schedule-hold-own.yaml \
                         "train.init_from=$(realpath "${FIRST:?set FIRST to a folder of seed=S run links}")/seed=\${seed}" \
                         --grid seed="$SEEDS" --out "$STUDY/hold-own-schedule" "${SW[@]}" ;;
    still-schedule)    "$LF" sweep configs/cpu/schedule-hold-own.yaml "stages=[]" "${STILL[@]}" \
                         "train.init_from=$(realpath "$STUDY/settle-schedule/runs")/seed=\${seed}" \
                         --grid seed="$SEEDS" --out "$STUDY/still-schedule" "${SW[@]}" ;;
    settle-schedule)   "$LF" sweep configs/cpu/schedule-settle.yaml --grid seed="$SEEDS" --out "$STUDY/settle-schedule" \
                         "${SW[@]}" ;;
    lr-window-schedule) "$LF" sweep configs/cpu/schedule.yaml eval.max_loops=128 --grid seed=0 train.lr=1e-3,4e-3 \
                         --out "$STUDY/lr-window-schedule" "${SW[@]}" ;;
    looped-hold-schedule)
                       "$LF" sweep studies/stability/looped-hold.yaml "train.lr=${LR:-1e-4}" \
                         "train.init_from=$(realpath "${FIRST:?set FIRST to a folder of seed=S runs}")/seed=\${seed}" \
                         --grid seed="$SEEDS" --out "$STUDY/looped-hold-schedule-lr${LR:-1e-4}" "${SW[@]}" ;;
    collect)           collect studies/stability ;;
    *) echo "unknown stage: $1" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,37p' "$0"; exit 2; }
for s in "$@"; do stage "$s"; done
