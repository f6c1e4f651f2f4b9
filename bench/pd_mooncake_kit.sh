#!/usr/bin/env bash
# Build .whl/mooncake-slim.tar.xz (about 6.7 MB), which bench/h200_pd.sh carries beside the device
# kit: Mooncake's CUDA 13 transfer engine for the H200's Python 3.12, cut to what SGLang's PD
# transfer backend loads (`mooncake.engine`: engine.so, its libasio/etcd wrapper and the four
# bundled libraries it links), libibverbs/libmlx5 from the pyverbs wheel (vb/), and fallback/:
# Debian's libnuma.so.1 and a stand-in libcurl.so.4 (engine.so links libcurl for an HTTP metadata
# server that SGLang's P2P handshake never uses; every call of the stand-in fails cleanly).
#   bash bench/pd_mooncake_kit.sh          (from the project root; needs pip, apt-get, gcc, xz)
set -euo pipefail
OUT_TAR="$PWD/.whl/mooncake-slim.tar.xz"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$T" mooncake-transfer-engine-cuda13==0.3.14 pyverbs==56.0rc1 2>&1 |
  grep -v "is ignored" || true
S="$T/slim" L=mooncake_transfer_engine_cuda13.libs
mkdir -p "$S/mooncake" "$S/$L" "$S/vb" "$S/fallback" "$T/w"
unzip -q "$T"/mooncake_transfer_engine_cuda13-*.whl -d "$T/w"
cp "$T"/w/mooncake/{__init__.py,engine.so,libasio.so,libetcd_wrapper.so} "$S/mooncake/"
cp "$T"/w/$L/{libyaml-cpp,libjsoncpp,libglog,libgflags}-* "$S/$L/"
strip --strip-unneeded "$S"/mooncake/libetcd_wrapper.so "$S"/mooncake/libasio.so "$S"/$L/libyaml-cpp-*
unzip -q -j "$T"/pyverbs-*.whl 'pyverbs.libs/libibverbs-*' 'pyverbs.libs/libmlx5-*' 'pyverbs.libs/libnl-*' -d "$S/vb"
(cd "$S/vb" && ln -s libibverbs-*.so.* libibverbs.so.1 && ln -s libmlx5-*.so.* libmlx5.so.1)
(cd "$T" && apt-get download -q libnuma1 >/dev/null 2>&1 && dpkg -x libnuma1_*.deb deb)
cp -L "$T"/deb/usr/lib/x86_64-linux-gnu/libnuma.so.1 "$S/fallback/"
cat > "$T/curl.c" <<'C'
#include <stddef.h>
void *curl_easy_init(void) { return NULL; }
int curl_global_init(long flags) { (void)flags; return 0; }
void curl_easy_cleanup(void *h) { (void)h; }
char *curl_easy_escape(void *h, const char *s, int n) { (void)h; (void)s; (void)n; return NULL; }
int curl_easy_getinfo(void *h, int info, ...) { (void)h; (void)info; return 2; }
int curl_easy_perform(void *h) { (void)h; return 2; }
void curl_easy_reset(void *h) { (void)h; }
int curl_easy_setopt(void *h, int opt, ...) { (void)h; (void)opt; return 2; }
const char *curl_easy_strerror(int code) { (void)code; return "libcurl stand-in: not available"; }
void curl_free(void *p) { (void)p; }
void *curl_slist_append(void *l, const char *s) { (void)s; return l; }
void curl_slist_free_all(void *l) { (void)l; }
C
gcc -shared -fPIC -O2 -Wl,-soname,libcurl.so.4 -o "$S/fallback/libcurl.so.4" "$T/curl.c"
# every library engine.so needs resolves from here, but CUDA's (the device has those)
missing=$(LD_LIBRARY_PATH="$S/vb:$S/fallback" ldd "$S/mooncake/engine.so" | grep "not found" | grep -v -e libcuda -e libcudart || true)
[ -z "$missing" ] || { echo "unresolved: $missing"; exit 1; }
mkdir -p "$(dirname "$OUT_TAR")"
tar -C "$S" -cf - . | xz -T0 -9 > "$OUT_TAR"
ls -l "$OUT_TAR"
