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

/// `lb_endpoints` entries for `host:port` endpoints, indented for a
/// static cluster's `load_assignment`.
fn lb_endpoints(endpoints: &[String]) -> String {
    endpoints
        .iter()
        .map(|ep| {
            let (host, port) = ep.rsplit_once(':').unwrap_or((ep, "80"));
            format!(
                "        - endpoint:\n            address:\n              socket_address: {{ address: {host}, port_value: {port} }}\n"
            )
        })
        .collect()
}

pub fn render(template: &Path, v: &Vars) -> Result<String> {
    let text = std::fs::read_to_string(template)
        .with_context(|| format!("reading {}", template.display()))?;
    let endpoints = lb_endpoints(&v.fallback);
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

/// Where the comparison routes listen, and what they reach.
pub struct Comparison {
    pub least_request_port: u16,
    pub extproc_port: u16,
    /// `kvgate-extproc`'s gRPC listener.
    pub extproc_grpc_port: u16,
    pub workers: Vec<String>,
}

/// `yaml` with the routes kvgate is compared with: Envoy's least-request
/// balancing over the workers (a static cluster), and kvgate's decision
/// made outside the proxy through `ext_proc`, the peers' architecture,
/// into the same routed cluster the filter's listener uses.
pub fn with_comparison(yaml: &str, c: &Comparison) -> Result<String> {
    let listeners = EXTPROC_LISTENER
        .replace("${HEADER_HYGIENE}", header_hygiene(yaml)?)
        .replace("${TENANT_AUTH}", tenant_auth(yaml)?)
        .replace("${EXTPROC_PORT}", &c.extproc_port.to_string())
        + &LEAST_REQUEST_LISTENER
            .replace("${LEAST_REQUEST_PORT}", &c.least_request_port.to_string());
    let clusters = COMPARISON_CLUSTERS
        .replace("${EXTPROC_GRPC_PORT}", &c.extproc_grpc_port.to_string())
        .replace("${WORKER_ENDPOINTS}\n", &lb_endpoints(&c.workers));
    let at = yaml
        .find("\n  listeners:\n")
        .context("envoy.yaml has no static listeners")?
        + "\n  listeners:\n".len();
    let mut out = format!("{}{listeners}{}", &yaml[..at], &yaml[at..]);
    let at = out
        .find("\n  clusters:\n")
        .context("envoy.yaml has no static clusters")?
        + "\n  clusters:\n".len();
    out.insert_str(at, &clusters);
    if let Some(at) = out.find("${") {
        bail!(
            "unfilled placeholder in the comparison routes near {:?}",
            &out[at..(at + 30).min(out.len())]
        );
    }
    Ok(out)
}

/// `yaml` with a copy of the kvgate listener (on `port`, the filter's
/// router from `wasm` instead of `current`) right after it: another build
/// of the filter measured beside this one in the same Envoy, alternating.
/// Its VMs are its own (Envoy keys VMs by their code too) but share the
/// snapshot service's shared data and queues, which are keyed by vm_id.
pub fn with_baseline(
    yaml: &str,
    listen_port: u16,
    current: &str,
    port: u16,
    wasm: &str,
) -> Result<String> {
    let head = "  - name: kvgate_inference\n";
    let block = listener_block(yaml, head)?;
    let swap = |text: &str, from: &str, to: &str| -> Result<String> {
        anyhow::ensure!(
            text.matches(from).count() == 1,
            "the kvgate listener does not name {from:?} exactly once"
        );
        Ok(text.replacen(from, to, 1))
    };
    let copy = swap(block, head, "  - name: kvgate_inference_baseline\n")?;
    let copy = swap(
        &copy,
        &format!("port_value: {listen_port} "),
        &format!("port_value: {port} "),
    )?;
    let copy = swap(
        &copy,
        &format!("filename: \"{current}\""),
        &format!("filename: \"{wasm}\""),
    )?;
    let at = yaml.find(block).map_or(yaml.len(), |s| s + block.len());
    Ok(format!("{}{copy}{}", &yaml[..at], &yaml[at..]))
}

/// A block of the kvgate listener as `envoy.yaml` writes it: the line
/// `head`, and what follows it deeper (or, under a key, its list items),
/// so that the comparison listeners configure a piece exactly as the
/// kvgate listener does rather than from a copy.
fn listener_block<'a>(yaml: &'a str, head: &str) -> Result<&'a str> {
    let start = yaml
        .find(head)
        .with_context(|| format!("envoy.yaml has no {:?}", head.trim()))?;
    let indent = head.len() - head.trim_start().len();
    let items = format!("{}- ", " ".repeat(indent));
    let under_key = head.trim_end().ends_with(':');
    let mut end = start + head.len();
    for line in yaml[end..].split_inclusive('\n') {
        let deeper = line.len() - line.trim_start().len() > indent;
        if !(deeper || (under_key && line.starts_with(&items))) {
            break;
        }
        end += line.len();
    }
    Ok(&yaml[start..end])
}

/// The kvgate listener's header hygiene: its HTTP connection manager's
/// `early_header_mutation_extensions`.
fn header_hygiene(yaml: &str) -> Result<&str> {
    listener_block(yaml, "          early_header_mutation_extensions:\n")
}

/// The kvgate listener's tenant authentication: its `jwt_authn` filter,
/// with the stack's key.
fn tenant_auth(yaml: &str) -> Result<&str> {
    listener_block(yaml, "          - name: envoy.filters.http.jwt_authn\n")
}

/// The ext_proc listener: the kvgate listener's header hygiene, tenant
/// authentication and routed cluster, with the decision made by
/// `kvgate-extproc` over Envoy's gRPC client (HTTP/2, one connection pool
/// per worker thread, streams multiplexed).
///
/// Processing mode: the decision needs the whole body, so the body goes
/// BUFFERED in one message, as the filter reads it whole; response
/// headers are sent because they mark the end of prefill (the filter
/// releases its prefill booking at the first response byte); the
/// response body and trailers are not needed and do not cross. Envoy
/// closes the stream when the request ends, which frees its reservation.
/// `failure_mode_allow: false`: a request the server cannot decide is
/// refused, as the filter refuses what it cannot route.
const EXTPROC_LISTENER: &str = r#"  # Comparison: kvgate's decision outside the proxy, through ext_proc.
  - name: kvgate_extproc
    address:
      socket_address: { address: 127.0.0.1, port_value: ${EXTPROC_PORT} }
    per_connection_buffer_limit_bytes: 8388608
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: kvgate_extproc
          stream_idle_timeout: 300s
${HEADER_HYGIENE}          route_config:
            name: extproc
            virtual_hosts:
            - name: extproc
              domains: ["*"]
              routes:
              - match:
                  path: "/v1/completions"
                  headers: [{ name: ":method", string_match: { exact: POST } }]
                route: &extproc_routed
                  cluster: kvgate_workers
                  timeout: 300s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset-before-request
                    num_retries: 1
              - match:
                  path: "/v1/chat/completions"
                  headers: [{ name: ":method", string_match: { exact: POST } }]
                route: *extproc_routed
              - match: { prefix: "/" }
                route: { cluster: kvgate_fallback, timeout: 60s }
          http_filters:
${TENANT_AUTH}          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: { cluster_name: kvgate_extproc }
              failure_mode_allow: false
              # Per message; a stream lives as long as its request.
              message_timeout: 5s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: BUFFERED
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

"#;

/// Envoy's own least-request balancing over the workers, no kvgate.
const LEAST_REQUEST_LISTENER: &str = r#"  # Comparison: Envoy's least-request balancing over the workers.
  - name: least_request_baseline
    address:
      socket_address: { address: 127.0.0.1, port_value: ${LEAST_REQUEST_PORT} }
    per_connection_buffer_limit_bytes: 8388608
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: least_request
          route_config:
            name: least_request
            virtual_hosts:
            - name: least_request
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: kvgate_least_request, timeout: 300s }
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

"#;

const COMPARISON_CLUSTERS: &str = r#"  - name: kvgate_least_request
    type: STATIC
    lb_policy: LEAST_REQUEST
    connect_timeout: 2s
    load_assignment:
      cluster_name: kvgate_least_request
      endpoints:
      - lb_endpoints:
${WORKER_ENDPOINTS}
  # kvgate-extproc's gRPC listener: HTTP/2, as Envoy's gRPC client needs.
  - name: kvgate_extproc
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: kvgate_extproc
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: { address: 127.0.0.1, port_value: ${EXTPROC_GRPC_PORT} }

"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_listener_is_the_kvgate_listener_on_its_own_port_and_module() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let v = Vars {
            admin_port: 1,
            listen_port: 2,
            plain_port: 3,
            sidecar_port: 4,
            control_port: 5,
            wasm_path: "/new.wasm".into(),
            plugin_config: "{}".into(),
            fallback: vec!["127.0.0.1:6".into()],
            tenant_jwks: "{}".into(),
        };
        let yaml = render(&dir.join("envoy/envoy.yaml"), &v).unwrap();
        let out = with_baseline(&yaml, 2, "/new.wasm", 7, "/old.wasm").unwrap();
        let copy = listener_block(&out, "  - name: kvgate_inference_baseline\n").unwrap();
        let original = listener_block(&out, "  - name: kvgate_inference\n").unwrap();
        assert_eq!(
            copy.replace("_baseline", "")
                .replace("port_value: 7 ", "port_value: 2 ")
                .replace("/old.wasm", "/new.wasm"),
            original
        );
        assert_eq!(
            out.matches("/new.wasm").count(),
            2,
            "the service runs the current build"
        );
        assert_eq!(out.matches("/old.wasm").count(), 1);
    }

    #[test]
    fn the_extproc_listener_scrubs_what_the_kvgate_listener_scrubs() {
        let yaml = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../envoy/envoy.yaml"),
        )
        .unwrap();
        let hygiene = header_hygiene(&yaml).unwrap();
        let removed: Vec<&str> = hygiene
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- remove: "))
            .collect();
        for h in [
            "x-gateway-destination-endpoint",
            "x-data-parallel-rank",
            "x-kvgate-fallback",
            "x-kvgate-tenant",
            "x-envoy-retry-on",
        ] {
            assert!(removed.contains(&h), "{h} in {removed:?}");
        }
        assert_eq!(
            removed.len(),
            yaml.matches("- remove: ").count(),
            "the whole block, and only it"
        );
        assert!(hygiene.ends_with('\n') && !hygiene.contains("local_reply_config"));
        let c = Comparison {
            least_request_port: 1,
            extproc_port: 2,
            extproc_grpc_port: 3,
            workers: vec!["127.0.0.1:4".into()],
        };
        // The template's own placeholders, filled as `render` would.
        let mut rendered = yaml.clone();
        while let Some(at) = rendered.find("${") {
            let end = at + rendered[at..].find('}').unwrap() + 1;
            rendered.replace_range(at..end, "0");
        }
        let auth = tenant_auth(&rendered).unwrap();
        assert!(auth.contains("claim_to_headers") && auth.contains("allow_missing_or_failed"));
        assert!(
            !auth.contains("envoy.filters.http.wasm"),
            "the filter alone"
        );
        let out = with_comparison(&rendered, &c).unwrap();
        assert_eq!(out.matches("early_header_mutation_extensions:").count(), 2);
        assert_eq!(out.matches("claim_to_headers:").count(), 2);
    }
}
