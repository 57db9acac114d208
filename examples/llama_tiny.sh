#!/usr/bin/env bash
# A small Llama-like model on ptdp train's default corpus: RMSNorm, a SwiGLU MLP (width 352, about
# 8/3 of the hidden size), rotary positions, grouped-query attention (8 query heads sharing 2
# key/value heads), no biases in the linear layers and an untied output layer. 8 local CPU workers
# as TP=2 x PP=2 x DP=2 (each TP rank holds one key/value group). Extra flags are passed on, e.g.
#   examples/llama_tiny.sh --train-iters 50 --output-dir runs/llama-tiny
set -euo pipefail
exec ptdp train \
    --num-layers 4 --hidden-size 128 --num-attention-heads 8 --num-query-groups 2 \
    --ffn-hidden-size 352 --seq-length 128 \
    --normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 10000 \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --tp 2 --pp 2 "$@"
