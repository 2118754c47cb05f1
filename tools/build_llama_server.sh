#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the copy vendored in llama-cpp-python's sdist) for the bench's
# llama-server peer rows, with `llama-perplexity` (quant-eval's llama.cpp reference) and
# `llama-quantize` (GGUF files of other types) and `llama-tokenize` (its token ids of a text); see src/speculant/bench/llama_server.py, which looks
# for them in the same place. Usage: tools/build_llama_server.sh [VERSION]   (default 0.3.36; ~10 min
# on 2 cores)
#
# Installs into $SPECULANT_CACHE/peers/llama.cpp-VERSION/ (SPECULANT_CACHE defaults to
# ~/.cache/speculant): bin/ with the four programs and the shared libraries beside them (run them
# with LD_LIBRARY_PATH=<that bin dir>), and convert/ with convert_hf_to_gguf.py, its conversion/ package and the gguf-py it
# imports (PYTHONPATH=convert/gguf-py). Idempotent: does nothing when all of them are there. Atomic: builds
# in a temporary directory next to the destination and renames it into place at the end, so an
# interrupted build leaves nothing that looks installed.
#
# CPU features are chosen explicitly: llama.cpp's default native build dies with SIGILL in its AMX
# matmul on the project machines, so AMX is off, and AVX-512 (F, VNNI, BF16) is on only when
# /proc/cpuinfo lists it, so the same script builds on AVX2-only machines.
set -euo pipefail

VERSION="${1:-0.3.36}"
CACHE="${SPECULANT_CACHE:-$HOME/.cache/speculant}"
DEST="$CACHE/peers/llama.cpp-$VERSION"
PY="${PY:-python3}"

TOOLS="llama-server llama-perplexity llama-quantize llama-tokenize"
whole=yes
for t in $TOOLS; do [ -x "$DEST/bin/$t" ] || whole=no; done
if [ $whole = yes ] && [ -d "$DEST/convert/conversion" ]; then
    echo "llama.cpp $VERSION already installed: $DEST/bin ($TOOLS), $DEST/convert"
    exit 0
fi
command -v cmake >/dev/null || { echo "error: cmake is required (pip install cmake, or apt-get install cmake)" >&2; exit 1; }

has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
AVX512=$(onoff avx512f)
VNNI=OFF; BF16=OFF
if [ "$AVX512" = ON ]; then VNNI=$(onoff avx512_vnni); BF16=$(onoff avx512_bf16); fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') -> AVX512=$AVX512 VNNI=$VNNI BF16=$BF16"

mkdir -p "$CACHE/peers"
TMP=$(mktemp -d "$CACHE/peers/.llama.cpp-$VERSION.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$TMP/sdist"
mkdir "$TMP/src"
tar -xzf "$(ls "$TMP"/sdist/*.tar.gz | head -1)" -C "$TMP/src"
SRC=$(ls -d "$TMP"/src/*/vendor/llama.cpp | head -1)
[ -n "$SRC" ] && [ -f "$SRC/CMakeLists.txt" ] || { echo "error: no vendor/llama.cpp in the sdist" >&2; exit 1; }

cmake -S "$SRC" -B "$TMP/build" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512="$AVX512" -DGGML_AVX512_VNNI="$VNNI" -DGGML_AVX512_BF16="$BF16" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build "$TMP/build" -j"${JOBS:-2}" --target $TOOLS

# Keep only what running needs: build/bin (the binary and its shared libraries) and a record.
mkdir -p "$TMP/out/convert"
cp -a "$TMP/build/bin" "$TMP/out/bin"
# the converter (Hugging Face directory -> GGUF) and the gguf-py it was written against
cp -a "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$TMP/out/convert/"
LD_LIBRARY_PATH="$TMP/out/bin" "$TMP/out/bin/llama-server" --version >"$TMP/out/VERSION.txt" 2>&1 || true
cat >>"$TMP/out/VERSION.txt" <<EOF
llama-cpp-python $VERSION (vendor/llama.cpp), built $(date -u +%Y-%m-%dT%H:%M:%SZ)
cmake: GGML_NATIVE=OFF AVX/AVX2/FMA/F16C=ON AVX512=$AVX512 AVX512_VNNI=$VNNI AVX512_BF16=$BF16 AMX=OFF
EOF
chmod -R a+rX "$TMP/out"
rm -rf "$DEST"
mv "$TMP/out" "$DEST"
echo "installed: $DEST/bin/llama-server"
