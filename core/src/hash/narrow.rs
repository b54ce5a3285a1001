//! XXH3-64 of the short inputs a request hashes, with no 128-bit multiply.
//!
//! XXH3 folds 64×64-bit products to 64 bits. WebAssembly has no wide
//! multiply, so there each `u128` product is a call to compiler-rt's
//! `__multi3`, a general 128×128-bit product written back through the
//! stack: four calls a 16-token block and one a chain link, some 640 a
//! 2k-token prompt. Here each product is four 32×32-bit ones, inlined,
//! and the secret is read as words fixed at compile time. Native targets
//! keep the crate's hash, whose product is one instruction. The values
//! are XXH3's, bit for bit: the tests hold them to the crate's at every
//! length these take (16 bytes, and 17 to 128).

use xxhash_rust::const_xxh3::const_custom_default_secret;

/// XXH3's default secret (the one derived for seed 0), as words.
const SECRET: [u64; 24] = words(const_custom_default_secret(0));
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;

const fn words(bytes: [u8; 192]) -> [u64; 24] {
    let mut out = [0; 24];
    let mut i = 0;
    while i < 24 {
        let mut w = [0; 8];
        let mut j = 0;
        while j < 8 {
            w[j] = bytes[8 * i + j];
            j += 1;
        }
        out[i] = u64::from_le_bytes(w);
        i += 1;
    }
    out
}

/// The two little-endian words of the sixteen bytes of `b` from `at`;
/// zeros past its end (callers read inside their input).
fn pair(b: &[u8], at: usize) -> (u64, u64) {
    let Some(c) = b.get(at..).and_then(|rest| rest.first_chunk::<16>()) else {
        return (0, 0);
    };
    let (lo, hi) = c.split_at(8);
    (
        u64::from_le_bytes(lo.try_into().unwrap_or_default()),
        u64::from_le_bytes(hi.try_into().unwrap_or_default()),
    )
}

/// The 128-bit product of `a` and `b`, its halves xored together.
fn fold(a: u64, b: u64) -> u64 {
    const LOW: u64 = 0xFFFF_FFFF;
    let (a_lo, a_hi) = (a & LOW, a >> 32);
    let (b_lo, b_hi) = (b & LOW, b >> 32);
    let ll = a_lo * b_lo;
    // The carries taken in two steps, each sum below 2^64. LLVM turns
    // the usual three-term sum back into one wide product (`__multi3`);
    // this order it leaves as four.
    let mid = a_hi * b_lo + (ll >> 32);
    let mid2 = a_lo * b_hi + (mid & LOW);
    let high = a_hi * b_hi + (mid >> 32) + (mid2 >> 32);
    let low = (mid2 << 32) | (ll & LOW);
    low ^ high
}

fn avalanche(h: u64) -> u64 {
    let h = (h ^ (h >> 37)).wrapping_mul(PRIME_MX1);
    h ^ (h >> 32)
}

/// Sixteen input bytes from `at` against the secret's words from `k`.
fn mix16(input: &[u8], at: usize, k: usize, seed: u64) -> u64 {
    let (lo, hi) = pair(input, at);
    fold(
        lo ^ SECRET[k].wrapping_add(seed),
        hi ^ SECRET[k + 1].wrapping_sub(seed),
    )
}

/// XXH3-64 of 16 bytes: a chain link, a text chunk's key.
pub(super) fn sixteen(input: &[u8], seed: u64) -> u64 {
    let (first, last) = pair(input, 0);
    let lo = first ^ (SECRET[3] ^ SECRET[4]).wrapping_add(seed);
    let hi = last ^ (SECRET[5] ^ SECRET[6]).wrapping_sub(seed);
    avalanche(
        16u64
            .wrapping_add(lo.swap_bytes())
            .wrapping_add(hi)
            .wrapping_add(fold(lo, hi)),
    )
}

/// XXH3-64 of 17 to 128 bytes: a block of 5 to 32 tokens.
pub(super) fn upto128(input: &[u8], seed: u64) -> u64 {
    let n = input.len();
    let mut acc = (n as u64).wrapping_mul(PRIME64_1);
    // Pairs of sixteen bytes, one from each end, inward as far as the
    // input reaches.
    if n > 96 {
        acc = acc.wrapping_add(mix16(input, 48, 12, seed));
        acc = acc.wrapping_add(mix16(input, n - 64, 14, seed));
    }
    if n > 64 {
        acc = acc.wrapping_add(mix16(input, 32, 8, seed));
        acc = acc.wrapping_add(mix16(input, n - 48, 10, seed));
    }
    if n > 32 {
        acc = acc.wrapping_add(mix16(input, 16, 4, seed));
        acc = acc.wrapping_add(mix16(input, n - 32, 6, seed));
    }
    acc = acc.wrapping_add(mix16(input, 0, 0, seed));
    acc = acc.wrapping_add(mix16(input, n - 16, 2, seed));
    avalanche(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use xxhash_rust::xxh3::xxh3_64_with_seed;

    fn wide(a: u64, b: u64) -> u64 {
        let p = u128::from(a) * u128::from(b);
        p as u64 ^ (p >> 64) as u64
    }

    #[test]
    fn the_product_is_the_wide_one_at_the_edges() {
        for (a, b) in [
            (0, 0),
            (u64::MAX, u64::MAX),
            (u64::MAX, 1),
            (0xFFFF_FFFF, 0xFFFF_FFFF_0000_0000),
            (0x9E37_79B1_85EB_CA87, 0xC2B2_AE3D_27D4_EB4F),
        ] {
            assert_eq!(fold(a, b), wide(a, b), "{a:#x} × {b:#x}");
        }
    }

    #[test]
    fn dynamos_seed_on_a_block_and_a_link() {
        let block: Vec<u8> = (0..64u8).collect();
        assert_eq!(upto128(&block, 1337), xxh3_64_with_seed(&block, 1337));
        assert_eq!(
            sixteen(&block[..16], 1337),
            xxh3_64_with_seed(&block[..16], 1337)
        );
    }

    proptest! {
        #[test]
        fn products_agree(a in any::<u64>(), b in any::<u64>()) {
            prop_assert_eq!(fold(a, b), wide(a, b));
        }

        #[test]
        fn hashes_are_xxh3s(bytes in prop::collection::vec(any::<u8>(), 128), seed in any::<u64>()) {
            prop_assert_eq!(sixteen(&bytes[..16], seed), xxh3_64_with_seed(&bytes[..16], seed));
            for n in 17..=128 {
                prop_assert_eq!(upto128(&bytes[..n], seed), xxh3_64_with_seed(&bytes[..n], seed), "{} bytes", n);
            }
        }
    }
}
