#!/usr/bin/env bash
# Set up Vidur (microsoft/vidur), the simulator benchmarks/vs_vidur.py compares against:
# a checkout OUTSIDE this repository, its own venv, and the attention table it lacks.
#
#   benchmarks/peers/setup_vidur.sh [PEER_DIR] [VENV_DIR] [SOURCE]
#
# PEER_DIR (default /work/peers/vidur) receives the checkout; VENV_DIR (default
# /work/peers/vidur-venv) the venv. SOURCE is where the checkout comes from: a git directory
# (a bare mirror or a clone's .git), else https://github.com/microsoft/vidur is cloned.
# From a partial mirror, files whose objects are absent are skipped (the large
# attention.csv tables): nothing here needs them.
#
# Vidur's own requirements.txt, less what its simulator never imports: torch (profiling
# only), kaleido/seaborn/matplotlib for plots (vidur_runner.py writes none). Its metrics code
# imports wandb and plotly_express, so they are installed; wandb runs disabled.
# Then the attention.csv for Llama-2-7B on H100 that the snapshot lacks is written from
# tokenweir's roofline (vs_vidur.py --write-attention-table; see that file for the model).
# Vidur's PyPI package is not used: it downloads its tables from a model hub at start.
set -euo pipefail

PEER_DIR=${1:-/work/peers/vidur}
VENV_DIR=${2:-/work/peers/vidur-venv}
SOURCE=${3:-https://github.com/microsoft/vidur}
PYTHON=${PYTHON:-python3}
REPO_ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TOKENWEIR_PYTHON=${TOKENWEIR_PYTHON:-$REPO_ROOT/.venv/bin/python}
[ -x "$TOKENWEIR_PYTHON" ] || TOKENWEIR_PYTHON=python3  # writing the table needs no torch

checkout_from_git_dir() {  # $1: a git directory; every blob present is written out
    local git_dir=$1 mode type obj path skipped=0
    while IFS=$'\t' read -r meta path; do
        read -r mode type obj <<<"$meta"
        [ "$type" = blob ] || continue
        if git --git-dir="$git_dir" cat-file -e "$obj" 2>/dev/null; then
            mkdir -p "$PEER_DIR/$(dirname "$path")"
            git --git-dir="$git_dir" cat-file blob "$obj" >"$PEER_DIR/$path"
        else
            skipped=$((skipped + 1))
        fi
    done < <(git --git-dir="$git_dir" ls-tree -r HEAD)
    echo "checked out $(git --git-dir="$git_dir" rev-parse HEAD) into $PEER_DIR ($skipped absent files skipped)"
}

if [ ! -f "$PEER_DIR/vidur/simulator.py" ]; then
    mkdir -p "$PEER_DIR"
    if [ -d "$SOURCE" ]; then
        checkout_from_git_dir "$SOURCE"
    else
        git clone --depth 1 "$SOURCE" "$PEER_DIR"
    fi
fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/pip" install -q numpy pandas scikit-learn scipy wandb ddsketch fasteners plotly_express

cd "$REPO_ROOT"
VIDUR_PEER="$PEER_DIR" PYTHONPATH="$REPO_ROOT" "$TOKENWEIR_PYTHON" benchmarks/vs_vidur.py --write-attention-table
echo "Vidur ready: VIDUR_PEER=$PEER_DIR VIDUR_PYTHON=$VENV_DIR/bin/python"
