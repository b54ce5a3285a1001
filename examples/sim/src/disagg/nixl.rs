//! vLLM's NixlConnector request fields, as the engine reads them: a body's
//! `kv_transfer_params` says whether this request is the prefill leg (keep
//! the blocks for a remote decode) or the decode leg (pull them from a
//! remote prefill), and the prefill's answer hands the decode leg what it
//! needs to pull.

use serde_json::{Value, json};

/// Where a decode leg pulls its blocks from: the prefill's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePrefill {
    pub engine_id: String,
    pub request_id: String,
    /// The first KV-cache group's block ids; the sim has one group.
    pub block_ids: Vec<u32>,
    pub host: String,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NixlLeg {
    /// No transfer asked for: an ordinary request.
    Local,
    Prefill,
    Decode(RemotePrefill),
}

fn flag(params: &Value, key: &str) -> Result<bool, String> {
    match &params[key] {
        Value::Null => Ok(false),
        Value::Bool(b) => Ok(*b),
        _ => Err(format!("kv_transfer_params.{key} must be a boolean")),
    }
}

fn string(params: &Value, key: &str) -> Result<String, String> {
    match &params[key] {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::Null => Err(format!(
            "kv_transfer_params.{key} is required for a remote prefill"
        )),
        _ => Err(format!(
            "kv_transfer_params.{key} must be a non-empty string"
        )),
    }
}

fn block_list(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()))
        .collect()
}

/// Reads a body's `kv_transfer_params` (null when absent). Fields this
/// version does not know are ignored, as vLLM's connector ignores them.
pub fn classify(params: &Value) -> Result<NixlLeg, String> {
    if params.is_null() {
        return Ok(NixlLeg::Local);
    }
    if !params.is_object() {
        return Err("kv_transfer_params must be an object".into());
    }
    let decode = flag(params, "do_remote_decode")?;
    let prefill = flag(params, "do_remote_prefill")?;
    match (decode, prefill) {
        (false, false) => Ok(NixlLeg::Local),
        (true, true) => Err(
            "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill".into(),
        ),
        (true, false) => Ok(NixlLeg::Prefill),
        (false, true) => {
            let ids = &params["remote_block_ids"];
            // Per KV-cache group in current vLLM; older versions sent one
            // flat list, which is one group.
            let block_ids = match ids.as_array().and_then(|a| a.first()) {
                Some(Value::Array(_)) => ids.as_array().and_then(|groups| {
                    let lists: Option<Vec<Vec<u32>>> = groups.iter().map(block_list).collect();
                    lists.and_then(|l| l.into_iter().next())
                }),
                _ => block_list(ids),
            }
            .ok_or("kv_transfer_params.remote_block_ids must be a list of lists of block ids")?;
            let port = params["remote_port"]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
                .ok_or("kv_transfer_params.remote_port must be a TCP port")?;
            if let Some(tp) = params.get("tp_size")
                && !tp.is_null()
                && tp.as_u64().is_none_or(|t| t == 0)
            {
                return Err("kv_transfer_params.tp_size must be a positive integer".into());
            }
            Ok(NixlLeg::Decode(RemotePrefill {
                engine_id: string(params, "remote_engine_id")?,
                request_id: string(params, "remote_request_id")?,
                block_ids,
                host: string(params, "remote_host")?,
                port,
            }))
        }
    }
}

/// The `kv_transfer_params` a prefill leg answers with.
pub fn answer(
    engine_id: &str,
    request_id: &str,
    block_ids: &[u32],
    host: &str,
    port: u16,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [block_ids],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_prefill_leg_and_absent_params() {
        let leg = json!({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,
                         "remote_block_ids":null,"remote_host":null,"remote_port":null});
        assert_eq!(classify(&leg), Ok(NixlLeg::Prefill));
        assert_eq!(classify(&Value::Null), Ok(NixlLeg::Local));
        assert_eq!(classify(&json!({})), Ok(NixlLeg::Local));
        assert!(classify(&json!([])).is_err());
        assert!(classify(&json!({"do_remote_decode": "yes"})).is_err());
        assert!(classify(&json!({"do_remote_decode": true, "do_remote_prefill": true})).is_err());
    }

    #[test]
    fn a_prefill_answer_is_a_decode_leg() {
        let mut a = answer("e_dp0", "req-1", &[4, 5, 6], "127.0.0.1", 5601);
        a["dcp_size"] = json!(1);
        assert_eq!(
            classify(&a),
            Ok(NixlLeg::Decode(RemotePrefill {
                engine_id: "e_dp0".into(),
                request_id: "req-1".into(),
                block_ids: vec![4, 5, 6],
                host: "127.0.0.1".into(),
                port: 5601,
            }))
        );
        // Older vLLM: one flat list.
        let mut flat = a.clone();
        flat["remote_block_ids"] = json!([4, 5, 6]);
        assert!(matches!(classify(&flat), Ok(NixlLeg::Decode(r)) if r.block_ids == [4, 5, 6]));
    }

    #[test]
    fn partial_or_malformed_decode_params_are_refused() {
        let good = answer("e", "r", &[1], "h", 1);
        for (key, bad) in [
            ("remote_engine_id", Value::Null),
            ("remote_request_id", json!("")),
            ("remote_host", json!(7)),
            ("remote_port", json!(70000)),
            ("remote_port", json!("5600")),
            ("remote_block_ids", json!([[1, -2]])),
            ("remote_block_ids", json!("1,2")),
            ("remote_block_ids", Value::Null),
            ("tp_size", json!(0)),
        ] {
            let mut p = good.clone();
            p[key] = bad.clone();
            assert!(classify(&p).is_err(), "{key} = {bad}");
        }
    }
}
