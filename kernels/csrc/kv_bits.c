/* Per-channel-width KV code rows (kernels/kv_pack.py: pack_codes_var / unpack_codes_var, the layout's reference):
   each (token, head) row of D codes is one little-endian bitstream, channel d at bit offset sum(w[h, :d]) (its own
   width w[h, d] in [1, 8]), least-significant bit first, zero-padded to pk bytes.  Bit-identical to the PyTorch
   reference; one pass over the codes, a 64-bit accumulator per row. */
#include <stdint.h>
#include <string.h>

/* packed[n, h, :pk] from codes[n, h, :D] (int64, each < 2**w[h, d]; higher bits are dropped as the reference's
   per-bit mask does) and widths w[h, :D] (int64). */
void moeray_pack_codes_var(const long *codes, long N, long H, long D, const long *w, long pk, uint8_t *packed) {
    for (long n = 0; n < N; n++)
        for (long h = 0; h < H; h++) {
            const long *c = codes + (n * H + h) * D, *wh = w + h * D;
            uint8_t *out = packed + (n * H + h) * pk;
            uint64_t acc = 0;
            long nb = 0, o = 0;
            for (long d = 0; d < D; d++) {
                acc |= ((uint64_t)c[d] & ((1u << wh[d]) - 1)) << nb;
                nb += wh[d];
                while (nb >= 8) { out[o++] = (uint8_t)acc; acc >>= 8; nb -= 8; }
            }
            if (nb > 0 && o < pk) out[o++] = (uint8_t)acc;
            if (o < pk) memset(out + o, 0, (size_t)(pk - o));
        }
}

/* codes c[0, D) of one bitstream row in[0, pk) with widths w[0, D). */
static void unpack_code_row(const uint8_t *in, long pk, const long *w, long D, long *c) {
    uint64_t acc = 0;
    long nb = 0, i = 0;
    for (long d = 0; d < D; d++) {
        while (nb < w[d] && i < pk) { acc |= (uint64_t)in[i++] << nb; nb += 8; }
        c[d] = (long)(acc & ((1u << w[d]) - 1));
        acc >>= w[d];
        nb -= w[d];
    }
}

/* codes[n, h, :D] (int64) from packed[n, h, :pk] and widths w[h, :D]. */
void moeray_unpack_codes_var(const uint8_t *packed, long N, long H, long D, const long *w, long pk, long *codes) {
    for (long n = 0; n < N; n++)
        for (long h = 0; h < H; h++)
            unpack_code_row(packed + (n * H + h) * pk, pk, w + h * D, D, codes + (n * H + h) * D);
}
