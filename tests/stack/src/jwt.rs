//! HS256 JWTs for the local stack's tenant example: Envoy's `jwt_authn`
//! verifies them against a per-stack key and copies the `tenant` claim
//! into the tenant header, as it would for an identity provider's tokens.

use anyhow::{Context, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::Read;

const KEY_ID: &str = "kvgate-local";

/// 32 random bytes from the OS.
pub fn new_key() -> Result<Vec<u8>> {
    let mut key = vec![0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .context("reading /dev/urandom for the tenant signing key")?;
    Ok(key)
}

/// The JWKS (one symmetric key) Envoy verifies with.
pub fn jwks(key: &[u8]) -> String {
    serde_json::json!({"keys": [{
        "kty": "oct",
        "alg": "HS256",
        "kid": KEY_ID,
        "k": base64url(key),
    }]})
    .to_string()
}

pub fn sign_hs256(key: &[u8], claims: &serde_json::Value) -> String {
    let header = serde_json::json!({"alg": "HS256", "typ": "JWT", "kid": KEY_ID});
    let signing_input = format!(
        "{}.{}",
        base64url(header.to_string().as_bytes()),
        base64url(claims.to_string().as_bytes())
    );
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(signing_input.as_bytes());
    format!(
        "{signing_input}.{}",
        base64url(&mac.finalize().into_bytes())
    )
}

/// Unpadded base64url (RFC 7515 §2).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_matches_rfc_4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64url(input.as_bytes()), want);
        }
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn hs256_matches_rfc_7515_appendix_a1() {
        // The example key and signing input of RFC 7515 A.1.
        let k = "AyM1SysPpbyDfgZld3umj1qzKObwVMkoqQ-EstJQLr_T-1qS0gZH75aKtMN3Yj0iPS4hcgUuTwjAzZr1Z9CAow";
        let key = decode(k);
        let input = "eyJ0eXAiOiJKV1QiLA0KICJhbGciOiJIUzI1NiJ9.eyJpc3MiOiJqb2UiLA0KICJleHAiOjEzMDA4MTkzODAsDQogImh0dHA6Ly9leGFtcGxlLmNvbS9pc19yb290Ijp0cnVlfQ";
        let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
        mac.update(input.as_bytes());
        assert_eq!(
            base64url(&mac.finalize().into_bytes()),
            "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"
        );
    }

    fn decode(s: &str) -> Vec<u8> {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut bits = 0u32;
        let mut n = 0;
        let mut out = Vec::new();
        for c in s.bytes() {
            let v = ALPHABET.iter().position(|&a| a == c).unwrap() as u32;
            bits = bits << 6 | v;
            n += 6;
            if n >= 8 {
                n -= 8;
                out.push((bits >> n) as u8);
            }
        }
        out
    }
}
