//! Renders `envoy/envoy.yaml` for one stack.

use anyhow::{Context, Result, bail};
use std::path::Path;

pub struct Vars {
    pub admin_port: u16,
    pub listen_port: u16,
    pub plain_port: u16,
    pub sidecar_port: u16,
    pub control_port: u16,
    pub wasm_path: String,
    pub plugin_config: String,
    pub fallback: Vec<String>,
    pub tenant_jwks: String,
}

/// The plugin configuration for the stack: quick polling so tests see
/// changes fast, with the caller's keys on top.
pub fn plugin_config(overrides: &serde_json::Value) -> String {
    let mut cfg = serde_json::json!({
        "poll_wait_ms": 1000,
        "stale_after_ms": 3000,
        "on_stale": "fail_open",
    });
    if let (Some(base), Some(extra)) = (cfg.as_object_mut(), overrides.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    cfg.to_string()
}

pub fn render(template: &Path, v: &Vars) -> Result<String> {
    let text = std::fs::read_to_string(template)
        .with_context(|| format!("reading {}", template.display()))?;
    let endpoints: String = v
        .fallback
        .iter()
        .map(|ep| {
            let (host, port) = ep.rsplit_once(':').unwrap_or((ep, "80"));
            format!(
                "        - endpoint:\n            address:\n              socket_address: {{ address: {host}, port_value: {port} }}\n"
            )
        })
        .collect();
    // The plugin JSON sits inside a single-quoted YAML scalar.
    let plugin = v.plugin_config.replace('\'', "''");
    let out = text
        .replace("${ADMIN_PORT}", &v.admin_port.to_string())
        .replace("${LISTEN_PORT}", &v.listen_port.to_string())
        .replace("${PLAIN_PORT}", &v.plain_port.to_string())
        .replace("${SIDECAR_PORT}", &v.sidecar_port.to_string())
        .replace("${CONTROL_PORT}", &v.control_port.to_string())
        .replace("${WASM_PATH}", &v.wasm_path)
        .replace("${PLUGIN_CONFIG}", &plugin)
        .replace("${TENANT_JWKS}", &v.tenant_jwks.replace('\'', "''"))
        .replace("${FALLBACK_ENDPOINTS}\n", &endpoints);
    if let Some(at) = out.find("${") {
        bail!(
            "unfilled placeholder in envoy.yaml near {:?}",
            &out[at..(at + 30).min(out.len())]
        );
    }
    Ok(out)
}

/// `yaml` with the bootstrap snapshot service taken out: what a host that
/// loads HTTP filters only runs.
pub fn without_snapshot_service(yaml: &str) -> Result<String> {
    let start = yaml
        .find("bootstrap_extensions:")
        .context("envoy.yaml has no bootstrap_extensions")?;
    let end = yaml[start..]
        .find("\nstatic_resources:")
        .map(|i| start + i + 1)
        .context("envoy.yaml has no static_resources after its bootstrap_extensions")?;
    let out = format!("{}{}", &yaml[..start], &yaml[end..]);
    if out.contains("WasmService") {
        bail!("envoy.yaml still names a WasmService once its bootstrap extensions are out");
    }
    Ok(out)
}
