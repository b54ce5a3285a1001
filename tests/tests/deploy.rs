//! The deploy manifests, as `cargo xtask images` renders them from the
//! templates in `deploy/` into `target/dist/deploy/`: every YAML parses;
//! every image reference and digest pin is the built images'; the custom
//! resources carry what their platform requires (the filter's image and
//! digest, its root id, the routed cluster's destination header); the
//! catalog each platform routes to is kvgate.toml's; kvgate.toml parses
//! with the sidecar's own parser; every plugin configuration loads in the
//! real filter; and what translates to Envoy configuration loads in real
//! Envoy (`envoy --mode validate`, which also starts the filter's VMs) with
//! the `.wasm` from the filter image's layer.
//! The Kubernetes kinds' schemas are checked by `cargo xtask test`
//! (kubernetes-validate).

use kvgate_sidecar::config::Config;
use kvgate_stack::Paths;
use kvgate_tests::host::{Filter, Shared, Vm};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The header kvgate's filter names its destination in, unless configured.
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
const ROUTER_ROOT: &str = "kvgate_router";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `target/dist/` (`KVGATE_DIST_DIR`), where `cargo xtask images` writes.
fn dist() -> PathBuf {
    let d = Paths::discover().unwrap().dist;
    assert!(
        d.join("images.json").exists(),
        "{} has no images: `cargo xtask test` (or `cargo xtask images --registry REGISTRY`) builds them and renders the manifests",
        d.display()
    );
    d
}

/// The rendered manifests.
fn rendered() -> PathBuf {
    dist().join("deploy")
}

/// `target/dist/images.json`: each image's reference, digest and sizes.
fn images() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dist().join("images.json")).unwrap()).unwrap()
}

/// The filter as the filter image's layer holds it (unpacked by the
/// images check).
fn layer_wasm() -> PathBuf {
    let p = dist().join("unpacked/kvgate-filter/plugin.wasm");
    assert!(
        p.exists(),
        "{} is missing: the images check unpacks it",
        p.display()
    );
    p.canonicalize().unwrap()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

/// Every document of every rendered manifest, and of the alert rules
/// under deploy/prometheus, as JSON.
fn documents() -> Vec<(PathBuf, Value)> {
    let mut files = Vec::new();
    yaml_files(&rendered(), &mut files);
    yaml_files(&repo().join("deploy/prometheus"), &mut files);
    files.sort();
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for d in serde_norway::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if !v.is_null() {
                docs.push((f.clone(), v));
            }
        }
    }
    docs
}

/// Kubernetes objects: every document outside deploy/prometheus (rule
/// files, checked by promtool).
fn objects() -> Vec<(PathBuf, Value)> {
    let prom = repo().join("deploy/prometheus");
    documents()
        .into_iter()
        .filter(|(f, _)| !f.starts_with(&prom))
        .collect()
}

fn of_kind(kind: &str) -> Vec<Value> {
    objects()
        .into_iter()
        .filter(|(_, v)| v["kind"] == kind)
        .map(|(_, v)| v)
        .collect()
}

fn one(kind: &str) -> Value {
    let all = of_kind(kind);
    assert_eq!(all.len(), 1, "expected one {kind}, found {}", all.len());
    all.into_iter().next().unwrap()
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{pointer} missing in {v}"))
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn configmap(name: &str) -> Value {
    of_kind("ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no ConfigMap {name}"))
}

fn sidecar_config() -> Config {
    let cm = configmap("kvgate-sidecar-config");
    Config::parse(str_at(&cm, "/data/kvgate.toml"))
        .unwrap_or_else(|e| panic!("deploy/kubernetes/kvgate-config.yaml: {e}"))
}

/// The plain Deployment's Envoy configuration, as the init container
/// renders it, with the .wasm at `wasm`.
fn plain_envoy_config(wasm: &Path) -> String {
    let cm = configmap("kvgate-envoy-config");
    str_at(&cm, "/data/envoy.yaml")
        .replace("/etc/kvgate/wasm/plugin.wasm", &wasm.display().to_string())
        .replace("__KVGATE_CONTROL_TOKEN__", "0123456789abcdef")
}

#[test]
fn every_manifest_parses_and_names_itself() {
    let objs = objects();
    assert!(
        objs.len() >= 20,
        "only {} objects under deploy/",
        objs.len()
    );
    for (f, v) in &objs {
        for key in ["/apiVersion", "/kind", "/metadata/name"] {
            let s = v.pointer(key).and_then(Value::as_str).unwrap_or("");
            assert!(!s.is_empty(), "{}: a document without {key}", f.display());
        }
    }
    // The rule files parse as YAML too (promtool checks what they say).
    assert!(documents().len() > objs.len());
}

/// Every object under `v` that names a container `kvgate-sidecar` and its
/// image.
fn sidecar_images<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(o) => {
            if o.get("name").and_then(Value::as_str) == Some("kvgate-sidecar")
                && let Some(image) = o.get("image").and_then(Value::as_str)
            {
                out.push(image);
            }
            o.values().for_each(|c| sidecar_images(c, out));
        }
        Value::Array(a) => a.iter().for_each(|c| sidecar_images(c, out)),
        _ => {}
    }
}

#[test]
fn the_rendered_manifests_pin_the_built_images() {
    let images = images();
    let sidecar = str_at(&images, "/kvgate-sidecar/reference");
    let filter = str_at(&images, "/kvgate-filter/reference");
    let digest = str_at(&images, "/kvgate-filter/digest");
    let hex = digest.strip_prefix("sha256:").unwrap();
    assert!(is_sha256(hex));
    // The digests are the archives' own (the images check reads each
    // archive back against them).
    for (name, reference) in [("kvgate-sidecar", sidecar), ("kvgate-filter", filter)] {
        let recorded = std::fs::read_to_string(dist().join(format!("{name}.digest"))).unwrap();
        assert!(reference.contains(&format!("/{name}:")), "{reference}");
        assert!(
            reference.ends_with(&format!("@{}", recorded.trim())),
            "{reference}"
        );
    }

    // Every kvgate-sidecar container, on each platform, runs the image.
    let objs = objects();
    let mut found = Vec::new();
    for (_, v) in &objs {
        sidecar_images(v, &mut found);
    }
    assert_eq!(found.len(), 3, "plain, Envoy Gateway and Istio: {found:?}");
    assert!(found.iter().all(|i| *i == sidecar), "{found:?}");

    // The plain Deployment mounts the filter image's layer.
    let d = of_kind("Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "kvgate-gateway")
        .unwrap();
    let volume = d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["image"].is_object())
        .expect("the filter's image volume");
    assert_eq!(str_at(volume, "/image/reference"), filter);

    // Envoy Gateway and Istio pull the filter by tag and pin its digest.
    let by_tag = filter.split('@').next().unwrap();
    let code = &one("EnvoyExtensionPolicy")["spec"]["wasm"][0]["code"];
    assert_eq!(code["type"], "Image");
    assert_eq!(str_at(code, "/image/url"), by_tag);
    assert_eq!(str_at(code, "/image/sha256"), hex);
    let wp = one("WasmPlugin");
    assert_eq!(str_at(&wp, "/spec/url"), format!("oci://{by_tag}"));
    assert_eq!(str_at(&wp, "/spec/sha256"), hex);

    // No template variable is left but the init container's shell one.
    let mut files = Vec::new();
    yaml_files(&rendered(), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f)
            .unwrap()
            .replace("${KVGATE_CONTROL_TOKEN}", "");
        assert!(!text.contains("${"), "{} keeps a variable", f.display());
        assert!(!text.contains("example.com"), "{}", f.display());
    }
}

#[test]
fn the_filter_images_layer_is_the_built_filter() {
    let layer = std::fs::read(layer_wasm()).unwrap();
    let built = std::fs::read(dist().join("kvgate_filter.wasm")).unwrap();
    assert!(
        layer == built,
        "the filter image's /plugin.wasm is not target/dist/kvgate_filter.wasm"
    );
}

#[test]
fn kvgate_toml_parses_with_the_sidecars_parser() {
    let c = sidecar_config();
    assert!(!c.models.is_empty() && !c.workers.is_empty());
    assert!(
        c.server.listen.ip().is_loopback(),
        "the sidecar must listen on the pod's loopback only"
    );
    assert!(
        c.control.token_file.is_none(),
        "the token comes from a Secret"
    );
}

/// The catalog's worker addresses, as Envoy connects to them.
fn catalog() -> BTreeSet<String> {
    sidecar_config()
        .workers
        .iter()
        .map(|w| w.endpoint.clone())
        .collect()
}

#[test]
fn platforms_route_to_the_catalog_by_the_destination_header() {
    // Plain Envoy: EDS from the sidecar, override-host on the header.
    let envoy: Value = serde_norway::from_str(&plain_envoy_config(Path::new("x"))).unwrap();
    let clusters = envoy["static_resources"]["clusters"].as_array().unwrap();
    let routed = clusters
        .iter()
        .find(|c| c["name"] == "kvgate_workers")
        .expect("kvgate_workers cluster");
    assert_eq!(routed["type"], "EDS");
    assert_eq!(override_header(routed), DESTINATION_HEADER);

    // Envoy Gateway: a Backend holding the catalog, BackendTrafficPolicy's
    // endpoint override on the header, on the route to that Backend.
    let backend = one("Backend");
    let eg: BTreeSet<String> = backend["spec"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| format!("{}:{}", str_at(e, "/ip/address"), e["ip"]["port"]))
        .collect();
    assert_eq!(eg, catalog(), "Envoy Gateway's Backend is not the catalog");
    let btp = one("BackendTrafficPolicy");
    assert_eq!(
        str_at(
            &btp,
            "/spec/loadBalancer/endpointOverride/extractFrom/0/header"
        ),
        DESTINATION_HEADER
    );
    let route = one("HTTPRoute");
    assert_eq!(
        str_at(&btp, "/spec/targetRefs/0/name"),
        str_at(&route, "/metadata/name")
    );
    for rule in route["spec"]["rules"].as_array().unwrap() {
        assert_eq!(rule["backendRefs"][0]["kind"], "Backend");
        assert_eq!(rule["backendRefs"][0]["name"], backend["metadata"]["name"]);
    }

    // Istio: a ServiceEntry holding the catalog, its cluster merged with
    // override-host on the header, the VirtualService routing to it.
    let se = one("ServiceEntry");
    let host = str_at(&se, "/spec/hosts/0");
    let port = &se["spec"]["ports"][0];
    let istio: BTreeSet<String> = se["spec"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| format!("{}:{}", str_at(e, "/address"), port["number"]))
        .collect();
    assert_eq!(istio, catalog(), "Istio's ServiceEntry is not the catalog");
    let vs = one("VirtualService");
    assert_eq!(str_at(&vs, "/spec/http/0/route/0/destination/host"), host);
    let merge = istio_patches("CLUSTER")
        .into_iter()
        .find(|p| p["patch"]["operation"] == "MERGE")
        .expect("a CLUSTER MERGE patch");
    assert_eq!(str_at(&merge, "/match/cluster/service"), host);
    assert_eq!(merge["match"]["cluster"]["portNumber"], port["number"]);
    assert_eq!(
        override_header(&merge["patch"]["value"]),
        DESTINATION_HEADER
    );
}

/// The header an override-host load-balancing policy reads.
fn override_header(cluster: &Value) -> &str {
    let policy = &cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"];
    assert_eq!(
        policy["name"],
        "envoy.load_balancing_policies.override_host"
    );
    str_at(policy, "/typed_config/override_host_sources/0/header")
}

fn istio_patches(apply_to: &str) -> Vec<Value> {
    one("EnvoyFilter")["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["applyTo"] == apply_to)
        .cloned()
        .collect()
}

fn eg_patches(kind: &str) -> Vec<Value> {
    let epp = one("EnvoyPatchPolicy");
    assert_eq!(epp["spec"]["type"], "JSONPatch");
    assert_eq!(epp["spec"]["targetRef"]["kind"], "Gateway");
    epp["spec"]["jsonPatches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| str_at(p, "/type") == format!("type.googleapis.com/envoy.config.{kind}"))
        .cloned()
        .collect()
}

/// Whole resources a patch adds (an `add` without a path).
fn added(patches: &[Value], value: &str) -> Vec<Value> {
    patches
        .iter()
        .filter(|p| p.pointer(value).is_some_and(|v| v.get("name").is_some()))
        .map(|p| p.pointer(value).cloned().unwrap())
        .collect()
}

#[test]
fn custom_resources_carry_their_required_fields() {
    // Envoy Gateway's filter: Image (or HTTP) code with its sha256, the
    // router's root id, the HTTP-filter-only mode.
    let eep = one("EnvoyExtensionPolicy");
    assert_eq!(eep["spec"]["targetRefs"][0]["kind"], "Gateway");
    let wasm = &eep["spec"]["wasm"][0];
    assert_eq!(wasm["rootID"], ROUTER_ROOT);
    let source = match str_at(wasm, "/code/type") {
        "HTTP" => "http",
        "Image" => "image",
        other => panic!("wasm code type {other}"),
    };
    let url = str_at(wasm, &format!("/code/{source}/url"));
    assert!(
        url.starts_with("https://") || source == "image",
        "wasm URL {url}"
    );
    assert!(is_sha256(str_at(wasm, &format!("/code/{source}/sha256"))));
    assert_eq!(wasm["config"]["poller"], "lease");

    // The EnvoyPatchPolicy adds the sidecar's cluster at the sidecar's
    // listen address, and flags the policy's wasm filter by its xDS name.
    let listen = sidecar_config().server.listen;
    let clusters = added(&eg_patches("cluster.v3.Cluster"), "/operation/value");
    assert_eq!(sidecar_address(&clusters), listen.to_string());
    let flag = eg_patches("listener.v3.Listener")
        .into_iter()
        .find(|p| p["operation"]["jsonPath"].is_string())
        .expect("the stop-iteration patch");
    let filter_name = format!(
        "envoy.filters.http.wasm/envoyextensionpolicy/{}/{}/wasm/0",
        str_at(&eep, "/metadata/namespace"),
        str_at(&eep, "/metadata/name")
    );
    assert!(str_at(&flag, "/operation/jsonPath").contains(&filter_name));
    assert_eq!(
        str_at(&flag, "/operation/path"),
        "typed_config/config/allow_on_headers_stop_iteration"
    );
    // The Envoy pods carry the sidecar.
    let proxy = one("EnvoyProxy");
    let containers = &proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]["value"]
        ["spec"]["template"]["spec"]["containers"];
    assert!(has_sidecar(containers), "EnvoyProxy adds no kvgate-sidecar");

    // Istio's filter: a URL with its sha256, the router's root id.
    let wp = one("WasmPlugin");
    let url = str_at(&wp, "/spec/url");
    assert!(
        url.starts_with("oci://") || url.starts_with("https://"),
        "{url}"
    );
    assert!(is_sha256(str_at(&wp, "/spec/sha256")));
    assert_eq!(wp["spec"]["pluginName"], ROUTER_ROOT);
    assert_eq!(wp["spec"]["type"], "HTTP");
    assert_eq!(wp["spec"]["pluginConfig"]["poller"], "lease");
    let selector = &wp["spec"]["selector"]["matchLabels"];
    assert!(selector.is_object(), "WasmPlugin selects no workload");
    let clusters = added(&istio_patches("CLUSTER"), "/patch/value");
    assert_eq!(sidecar_address(&clusters), listen.to_string());
    // The gateway Deployment the WasmPlugin selects carries the sidecar.
    let gw = of_kind("Deployment")
        .into_iter()
        .find(|d| d["spec"]["template"]["metadata"]["labels"]["istio"] == selector["istio"])
        .expect("the Istio gateway Deployment");
    assert!(has_sidecar(&gw["spec"]["template"]["spec"]["containers"]));
}

fn has_sidecar(containers: &Value) -> bool {
    containers
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["name"] == "kvgate-sidecar" && c["args"][1] == "/etc/kvgate/kvgate.toml")
}

/// Where the `kvgate_sidecar` cluster among `clusters` connects.
fn sidecar_address(clusters: &[Value]) -> String {
    let c = clusters
        .iter()
        .find(|c| c["name"] == "kvgate_sidecar")
        .expect("a kvgate_sidecar cluster");
    let a = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    format!("{}:{}", str_at(a, "/address"), a["port_value"])
}

#[test]
fn the_plain_deployment_runs_both_containers_unprivileged() {
    let d = of_kind("Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "kvgate-gateway")
        .expect("the kvgate-gateway Deployment");
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["automountServiceAccountToken"], false);
    let containers = pod["containers"].as_array().unwrap();
    let names: Vec<&str> = containers.iter().map(|c| str_at(c, "/name")).collect();
    assert_eq!(names, ["envoy", "kvgate-sidecar"]);
    assert!(has_sidecar(&pod["containers"]));
    for c in containers
        .iter()
        .chain(pod["initContainers"].as_array().unwrap())
    {
        let sc = &c["securityContext"];
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{}", c["name"]);
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{}", c["name"]);
        assert!(sc["runAsUser"].as_u64().unwrap_or(0) > 0, "{}", c["name"]);
        assert!(c["resources"]["requests"]["memory"].is_string());
    }
    for c in containers {
        assert!(c["readinessProbe"].is_object() && c["livenessProbe"].is_object());
    }
    // The probes and Prometheus paths are routes of Envoy's observe
    // listener.
    let envoy: Value = serde_norway::from_str(&plain_envoy_config(Path::new("x"))).unwrap();
    let observe = envoy["static_resources"]["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "kvgate_observe")
        .expect("the observe listener");
    let routes = observe
        .pointer("/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes")
        .unwrap();
    let paths: BTreeSet<&str> = routes
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["match"]["path"].as_str())
        .collect();
    for c in containers {
        if let Some(p) = c["readinessProbe"]["httpGet"]["path"].as_str() {
            assert!(paths.contains(p), "probe path {p} is not routed");
        }
    }
    assert!(paths.contains("/stats/prometheus") && paths.contains("/sidecar/metrics"));
    // The control Service is cluster-internal.
    for s in of_kind("Service") {
        let t = s["spec"]["type"].as_str().unwrap_or("ClusterIP");
        assert_eq!(t, "ClusterIP", "{}", s["metadata"]["name"]);
    }
}

fn filter() -> &'static Filter {
    kvgate_tests::shared_filter()
}

/// The filter's configuration without `poller`, when the filter refuses
/// that key: the HTTP-filter-only mode (issue 16) is not in every build.
/// Everything else in it must load either way.
fn loadable(filter: &Filter, root: &str, config: &Value) -> Value {
    let shared = Shared::new();
    let vm = Vm::start(filter, &shared, "kvgate", root, &config.to_string()).unwrap();
    if vm.configured {
        return config.clone();
    }
    let mut without = config.clone();
    let had = without
        .as_object_mut()
        .and_then(|o| o.remove("poller"))
        .is_some();
    assert!(
        had && vm.logs().contains("poller"),
        "{root} refused {config}:\n{}",
        vm.logs()
    );
    let vm = Vm::start(filter, &shared, "kvgate", root, &without.to_string()).unwrap();
    assert!(vm.configured, "{root} refused {without}:\n{}", vm.logs());
    without
}

fn platform_plugin_configs() -> [Value; 2] {
    [
        one("EnvoyExtensionPolicy")["spec"]["wasm"][0]["config"].clone(),
        one("WasmPlugin")["spec"]["pluginConfig"].clone(),
    ]
}

#[test]
fn every_plugin_configuration_loads_in_the_real_filter() {
    let filter = filter();
    let envoy: Value = serde_norway::from_str(&plain_envoy_config(Path::new("x"))).unwrap();
    let service = str_at(
        &envoy,
        "/bootstrap_extensions/0/typed_config/config/configuration/value",
    );
    let service: Value = serde_json::from_str(service).unwrap();
    let configured = loadable(filter, "kvgate_snapshot_service", &service);
    assert_eq!(configured, service);
    for config in platform_plugin_configs() {
        assert_eq!(config["poller"], "lease");
        loadable(filter, ROUTER_ROOT, &config);
    }
}

fn envoy_validates(name: &str, config: &str) {
    let paths = Paths::discover().unwrap();
    assert!(
        paths.envoy.exists(),
        "{} is missing: cargo xtask test installs Envoy",
        paths.envoy.display()
    );
    let dir = paths.new_run_dir().unwrap();
    let file = dir.join(name);
    std::fs::write(&file, config).unwrap();
    let out = Command::new(&paths.envoy)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "Envoy refused {} ({name}):\n{}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_plain_envoy_configuration_loads_in_envoy() {
    envoy_validates("k8s-envoy.yaml", &plain_envoy_config(&layer_wasm()));
}

/// A wasm HTTP filter as Envoy Gateway and Istio generate it for the
/// router root with `config`.
fn wasm_http_filter(vm_id: &str, config: &Value) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": ROUTER_ROOT,
                "root_id": ROUTER_ROOT,
                "vm_config": {
                    "vm_id": vm_id,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": layer_wasm()}}
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": config.to_string()
                },
                "allow_on_headers_stop_iteration": true
            }
        }
    })
}

/// An HTTP listener on an ephemeral loopback port with `filters` before
/// the router, routing everything to `cluster`.
fn listener(name: &str, filters: Vec<Value>, cluster: &str) -> Value {
    let mut http_filters = filters;
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    }));
    json!({
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "route_config": {"virtual_hosts": [{
                    "name": "all", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]
                }]},
                "http_filters": http_filters
            }
        }]}]
    })
}

fn bootstrap(clusters: Vec<Value>, listeners: Vec<Value>) -> String {
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"clusters": clusters, "listeners": listeners}
    })
    .to_string()
}

#[test]
fn envoy_gateway_patches_and_filter_load_in_envoy() {
    let filter = filter();
    let patches = eg_patches("cluster.v3.Cluster");
    let clusters = added(&patches, "/operation/value");
    let mut listeners = added(&eg_patches("listener.v3.Listener"), "/operation/value");
    let config = loadable(filter, ROUTER_ROOT, &platform_plugin_configs()[0]);
    listeners.push(listener(
        "gateway",
        vec![wasm_http_filter(
            "envoyextensionpolicy/llm/kvgate/wasm/0",
            &config,
        )],
        "kvgate_sidecar",
    ));
    envoy_validates("envoy-gateway.json", &bootstrap(clusters, listeners));
}

#[test]
fn istio_patches_and_filter_load_in_envoy() {
    let filter = filter();
    let patches = istio_patches("CLUSTER");
    let mut clusters = added(&patches, "/patch/value");
    // The ServiceEntry's cluster as Istio builds it, with the MERGE patch.
    let se = one("ServiceEntry");
    let port = se["spec"]["ports"][0]["number"].clone();
    let endpoints: Vec<Value> = se["spec"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| json!({"endpoint": {"address": {"socket_address": {"address": e["address"], "port_value": port}}}}))
        .collect();
    let name = format!("outbound|{port}||{}", str_at(&se, "/spec/hosts/0"));
    let mut routed = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]}
    });
    let merge = patches
        .iter()
        .find(|p| p["patch"]["operation"] == "MERGE")
        .unwrap();
    for (k, v) in merge["patch"]["value"].as_object().unwrap() {
        routed[k] = v.clone();
    }
    clusters.push(routed);
    let mut listeners = added(&istio_patches("LISTENER"), "/patch/value");
    let mut filters: Vec<Value> = istio_patches("HTTP_FILTER")
        .iter()
        .map(|p| p["patch"]["value"].clone())
        .collect();
    let config = loadable(filter, ROUTER_ROOT, &platform_plugin_configs()[1]);
    filters.push(wasm_http_filter("llm.kvgate", &config));
    listeners.push(listener("gateway", filters, &name));
    envoy_validates("istio.json", &bootstrap(clusters, listeners));
}
