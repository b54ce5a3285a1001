//! The benchmarks' KV events: vLLM 0.33 tagged maps, 16 blocks of 16
//! tokens (ids up to 150k) per event, 64 events per batch, chains of 512
//! blocks; engine hashes count up from `slot << 40`.

use rmpv::Value;

/// `per_slot` blocks for each of `slots` ranks, as (slot, batch payload).
pub fn batches(slots: u16, per_slot: usize) -> Vec<(u16, Vec<u8>)> {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut out = Vec::new();
    for slot in 0..slots {
        let mut engine = (slot as u64) << 40;
        let (mut made, mut parent) = (0usize, None::<u64>);
        while made < per_slot {
            let mut events = Vec::new();
            for _ in 0..64 {
                let hashes: Vec<Value> = (0..16)
                    .map(|_| {
                        engine += 1;
                        Value::from(engine)
                    })
                    .collect();
                let toks: Vec<Value> = (0..256).map(|_| Value::from(rnd() % 150_000)).collect();
                // Chains of 512 blocks, then a new root.
                let p = match parent {
                    Some(p) if made % 512 != 0 => Value::from(p),
                    _ => Value::Nil,
                };
                parent = Some(engine);
                events.push(Value::Map(vec![
                    ("type".into(), "BlockStored".into()),
                    ("block_hashes".into(), Value::Array(hashes)),
                    ("parent_block_hash".into(), p),
                    ("token_ids".into(), Value::Array(toks)),
                    ("block_size".into(), 16.into()),
                    ("lora_id".into(), Value::Nil),
                    ("medium".into(), "GPU".into()),
                    ("lora_name".into(), Value::Nil),
                ]));
                made += 16;
            }
            let b = Value::Array(vec![1.5f64.into(), Value::Array(events), 0.into()]);
            let mut buf = Vec::new();
            rmpv::encode::write_value(&mut buf, &b).expect("encoding into a Vec");
            out.push((slot, buf));
        }
    }
    out
}
