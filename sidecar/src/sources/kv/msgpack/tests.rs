use super::*;
use rmpv::Value;

fn enc(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

#[test]
fn integers_in_every_width() {
    for v in [
        0u64,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        u32::MAX as u64,
        u32::MAX as u64 + 1,
        u64::MAX,
    ] {
        let b = enc(&Value::from(v));
        assert_eq!(Reader::new(&b).int().unwrap(), Int::U(v), "{v}");
    }
    for v in [
        -1i64,
        -32,
        -33,
        -128,
        -129,
        -32768,
        -32769,
        i32::MIN as i64,
        i64::MIN,
    ] {
        let b = enc(&Value::from(v));
        assert_eq!(Reader::new(&b).int().unwrap(), Int::I(v), "{v}");
        assert_eq!(Reader::new(&b).int().unwrap().as_u64_bits(), v as u64);
    }
}

#[test]
fn u32_rejects_out_of_range() {
    let b = enc(&Value::from(u32::MAX as u64 + 1));
    assert!(matches!(
        Reader::new(&b).u32(),
        Err(MsgpackError::Overflow(0))
    ));
    let b = enc(&Value::from(-5i64));
    assert!(Reader::new(&b).u32().is_err());
}

#[test]
fn skip_walks_nested_values() {
    let v = Value::Map(vec![
        (
            Value::from("a"),
            Value::Array(vec![Value::from(1), Value::Nil, Value::from(2.5f64)]),
        ),
        (Value::from("b"), Value::Binary(vec![1, 2, 3])),
        (Value::from("c"), Value::Ext(5, vec![9; 20])),
    ]);
    let mut b = enc(&v);
    b.push(0x07);
    let mut r = Reader::new(&b);
    r.skip().unwrap();
    assert_eq!(r.int().unwrap(), Int::U(7));
}

#[test]
fn deep_nesting_is_refused() {
    let mut b = vec![0x91u8; 100];
    b.push(0xc0);
    assert!(matches!(
        Reader::new(&b).skip(),
        Err(MsgpackError::TooDeep(_))
    ));
}

#[test]
fn counts_beyond_the_bytes_left_are_refused() {
    let implausible = |count: usize, remaining: usize| MsgpackError::ImplausibleLength {
        offset: 0,
        count,
        remaining,
    };
    let a32 = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x01];
    assert_eq!(
        Reader::new(&a32).array_len(),
        Err(implausible(u32::MAX as usize, 1))
    );
    assert!(matches!(
        Reader::new(&a32).skip(),
        Err(MsgpackError::ImplausibleLength { .. })
    ));
    let a16 = [0xdc, 0x00, 0x03, 0x01, 0x02];
    assert_eq!(Reader::new(&a16).array_len(), Err(implausible(3, 2)));
    let m32 = [0xdf, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02];
    assert_eq!(
        Reader::new(&m32).map_len(),
        Err(implausible(u32::MAX as usize, 2))
    );
    // Two bytes cannot hold two entries of a key and a value each.
    let fixmap = [0x82, 0x01, 0x02, 0x03];
    assert_eq!(Reader::new(&fixmap).map_len(), Err(implausible(2, 3)));
    // Exactly enough bytes is fine.
    let ok = [0x93, 0x01, 0x02, 0x03];
    assert_eq!(Reader::new(&ok).array_len(), Ok(3));
    let ok = [0x81, 0x01, 0x02];
    assert_eq!(Reader::new(&ok).map_len(), Ok(1));
    let empty = [0x90];
    assert_eq!(Reader::new(&empty).array_len(), Ok(0));
}

#[test]
fn truncation_is_an_error() {
    let b = enc(&Value::from("hello world"));
    for cut in 0..b.len() {
        assert!(Reader::new(&b[..cut]).str().is_err());
        assert!(Reader::new(&b[..cut]).skip().is_err());
    }
}
