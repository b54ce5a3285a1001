//! The worker catalog as Envoy endpoints (EDS over REST, JSON).
//!
//! Envoy's routed cluster holds exactly the catalog's workers, and its
//! override-host load balancer only connects to a member: whatever a
//! request's destination header says, Envoy can reach no address the
//! catalog does not name. Envoy polls `POST /v3/discovery:endpoints`; the
//! answer carries every worker of every model, up or not: which worker may
//! take a request is the filter's decision, made from fresher state than a
//! poll, and an override-host balancer skips hosts Envoy thinks unhealthy.

use crate::fleet::Fleet;
use serde::Deserialize;
use serde_json::{Value, json};
use std::net::SocketAddr;

pub const CLA_TYPE: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// The parts of Envoy's `DiscoveryRequest` the answer depends on.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct DiscoveryRequest {
    pub resource_names: Vec<String>,
}

/// Envoy names at most a few clusters; more is not a request from Envoy.
const MAX_RESOURCES: usize = 16;

/// Answers one discovery request: a `ClusterLoadAssignment` per requested
/// cluster name, each listing the whole catalog.
pub fn discovery_response(fleet: &Fleet, req: &DiscoveryRequest) -> Result<Value, String> {
    if req.resource_names.is_empty() {
        return Err("resource_names must name the routed cluster".into());
    }
    if req.resource_names.len() > MAX_RESOURCES {
        return Err(format!(
            "at most {MAX_RESOURCES} resource names, got {}",
            req.resource_names.len()
        ));
    }
    let mut endpoints: Vec<SocketAddr> = fleet
        .workers()
        .values()
        .filter_map(|w| w.spec().endpoint.parse().ok())
        .collect();
    endpoints.sort();
    // Two catalog entries may share an endpoint (one engine serving two
    // model names): Envoy wants each address once.
    endpoints.dedup();
    let lb_endpoints: Vec<Value> = endpoints
        .iter()
        .map(|addr| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": addr.ip().to_string(),
                "port_value": addr.port(),
            }}}})
        })
        .collect();
    // The version names the content, so an unchanged catalog is an
    // unchanged version and Envoy skips the update.
    let version = format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(
            serde_json::to_string(&lb_endpoints)
                .unwrap_or_default()
                .as_bytes()
        )
    );
    let resources: Vec<Value> = req
        .resource_names
        .iter()
        .map(|name| {
            json!({
                "@type": CLA_TYPE,
                "cluster_name": name,
                "endpoints": [{"lb_endpoints": lb_endpoints}],
            })
        })
        .collect();
    Ok(json!({
        "version_info": version,
        "resources": resources,
        "type_url": CLA_TYPE,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn fleet() -> Fleet {
        let cfg = Config::parse(
            r#"
[[models]]
name = "a"
[[models]]
name = "b"
[[workers]]
worker_id = 2
model_name = "a"
endpoint = "10.0.0.2:8000"
[[workers]]
worker_id = 1
model_name = "a"
endpoint = "http://10.0.0.1:8000/"
[[workers]]
worker_id = 3
model_name = "b"
endpoint = "10.0.0.1:8000"
"#,
        )
        .unwrap();
        Fleet::new(&cfg).unwrap()
    }

    fn addresses(v: &Value) -> Vec<(String, u64)> {
        v["resources"][0]["endpoints"][0]["lb_endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let sa = &e["endpoint"]["address"]["socket_address"];
                (
                    sa["address"].as_str().unwrap().to_string(),
                    sa["port_value"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn lists_each_catalog_endpoint_once_per_requested_cluster() {
        let f = fleet();
        let req = DiscoveryRequest {
            resource_names: vec!["kvgate_workers".into()],
        };
        let v = discovery_response(&f, &req).unwrap();
        assert_eq!(v["type_url"], CLA_TYPE);
        assert_eq!(v["resources"][0]["@type"], CLA_TYPE);
        assert_eq!(v["resources"][0]["cluster_name"], "kvgate_workers");
        // Down or not (none has been scraped yet), each address once.
        assert_eq!(
            addresses(&v),
            vec![
                ("10.0.0.1".to_string(), 8000),
                ("10.0.0.2".to_string(), 8000)
            ]
        );
        let again = discovery_response(&f, &req).unwrap();
        assert_eq!(
            v["version_info"], again["version_info"],
            "same catalog, same version"
        );
    }

    #[test]
    fn the_catalog_changes_the_version_and_bad_requests_are_refused() {
        let mut f = fleet();
        let req = DiscoveryRequest {
            resource_names: vec!["kvgate_workers".into()],
        };
        let before = discovery_response(&f, &req).unwrap();
        f.remove_worker(2).unwrap();
        let after = discovery_response(&f, &req).unwrap();
        assert_ne!(before["version_info"], after["version_info"]);
        assert_eq!(addresses(&after), vec![("10.0.0.1".to_string(), 8000)]);
        assert!(discovery_response(&f, &DiscoveryRequest::default()).is_err());
        let many = DiscoveryRequest {
            resource_names: (0..100).map(|i| i.to_string()).collect(),
        };
        assert!(discovery_response(&f, &many).is_err());
    }
}
