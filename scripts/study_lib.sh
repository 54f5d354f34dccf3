# Shared settings and stages of the study scripts (sourced by studies/*/*_study.sh after
# they set STUDY, the folder of the study's sweeps). $LOOPFORMER overrides the command, $JOBS the parallel runs.
LF=${LOOPFORMER:-.venv/bin/loopformer}
export OMP_NUM_THREADS=1
SW=(--jobs "${JOBS:-2}" --threads 1 --quiet)
# the paper's parametrisation: adaLN-Zero gates (0) and one learning rate for all parameters
PAPER=(model.timestep_gate_init=0 train.optim.timestep_lr_mult=1)
# the circuit's plain 2,000-step recipe (configs/cpu/schedule.yaml before it took the stability study's recipe as its
# default): the overrides that run it as the depth study's and the stability study's earlier runs were made
SCHEDULE_AS_RUN=(model.state_noise=0 train.steps=2000 train.select.skip_spikes=0 train.select.keep_best=false
                 task.n_val=0 train.eval_every=0 train.optim.timestep_lr_mult=0.1)

# ablate DOCS STAGE...: each finished TMLT run of the stages at its trained r on 2,000 test rows — as trained, with
# the loops' average modulation, without modulation (`analyze dynamics`) — into DOCS/ablations/STAGE/RUN.md
ablate() {
  local docs=$1 tmp d run dest
  shift
  tmp=$(mktemp -d)
  for d in "$@"; do
    for run in "$STUDY/$d"/runs/*timestep=true/; do
      [ -d "$run" ] || continue
      dest="$docs/ablations/$d/$(basename "$run").md"
      [ -f "$run/results.json" ] && [ ! -f "$dest" ] || continue   # finished runs only
      "$LF" analyze dynamics "$run" -n 2000 --out "$tmp/$d-$(basename "$run")" >/dev/null
      mkdir -p "$(dirname "$dest")" && cp "$tmp/$d-$(basename "$run")/dynamics.md" "$dest"
    done
  done
  rm -rf "$tmp"
}

# collect DOCS: every sweep of the study into DOCS/<sweep>/ — its report (tables, loop-wise plot), every run's
# results.json and dynamics records, and the per-loop dynamics of the first seed's runs on 1,000 test rows
collect() {
  local docs=$1 d name run dest
  for d in "$STUDY"/*/; do
    name=$(basename "$d")
    [ -d "$d/runs" ] || continue
    "$LF" report "$d" --out "$docs/$name" >/dev/null || continue
    rm -f "$docs/$name/loops.png"
    for run in "$d"/runs/*/; do
      [ -f "$run/results.json" ] || continue
      dest="$docs/$name/runs/$(basename "$run")"
      mkdir -p "$dest"
      cp "$run/results.json" "$dest/"
      grep '"split": "dynamics"' "$run/metrics.jsonl" > "$dest/dynamics.jsonl" || rm -f "$dest/dynamics.jsonl"
      case "$(basename "$run")" in   # per-loop dynamics up to 2r for the first seed
        *seed=*) case "$(basename "$run")" in *seed=0*) ;; *) continue ;; esac ;;
      esac
      [ -f "$dest/dynamics.md" ] || "$LF" analyze dynamics "$run" -n 1000 --out "$dest" >/dev/null
    done
  done
}
