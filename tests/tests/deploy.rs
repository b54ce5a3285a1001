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
//! (kubernetes-validate). What reaches a worker (the allow-list of paths,
//! path normalization, the inference listener's buffer) is checked on the
//! four templates themselves, `envoy/envoy.yaml` included.

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

/// Every YAML document of `files`, in file order, as JSON.
fn parse_documents(mut files: Vec<PathBuf>) -> Vec<(PathBuf, Value)> {
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

/// Every document of every rendered manifest, and of the alert rules
/// under deploy/prometheus, as JSON.
fn documents() -> Vec<(PathBuf, Value)> {
    let mut files = Vec::new();
    yaml_files(&rendered(), &mut files);
    yaml_files(&repo().join("deploy/prometheus"), &mut files);
    parse_documents(files)
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
    // Every rule that forwards forwards there (the others answer
    // themselves: see
    // `envoy_gateway_routes_only_the_allowed_paths_and_normalizes_them`).
    let rules = route["spec"]["rules"].as_array().unwrap();
    let forwarding: Vec<&Value> = rules
        .iter()
        .filter(|r| r.get("backendRefs").is_some())
        .collect();
    assert!(!forwarding.is_empty());
    for rule in forwarding {
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
    let mut gateway = listener("gateway", filters, &name);
    // The merges on the gateway's listener and connection manager.
    for p in istio_patches("LISTENER")
        .iter()
        .filter(|p| p["patch"]["operation"] == "MERGE")
    {
        merge_patch(&mut gateway, &p["patch"]["value"]);
    }
    for p in istio_patches("NETWORK_FILTER") {
        assert_eq!(p["patch"]["operation"], "MERGE");
        merge_patch(
            &mut gateway["filter_chains"][0]["filters"][0],
            &p["patch"]["value"],
        );
    }
    listeners.push(gateway);
    envoy_validates("istio.json", &bootstrap(clusters, listeners));
}

/// `patch` merged into `into`, as an EnvoyFilter MERGE does for these
/// fields: objects key by key, anything else replaced.
fn merge_patch(into: &mut Value, patch: &Value) {
    match (into, patch) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge_patch(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b.clone(),
    }
}

// What reaches a worker, on the templates themselves (`envoy/envoy.yaml`,
// and under `deploy/` before rendering, which only fills in images): the
// allow-list of docs/fleet.md ("Paths"), the path normalization in front
// of it, and the inference listener's buffer against the filter's body
// limit. tests/tests/paths.rs sends the paths through real Envoy.

/// The methods and paths that reach a worker, in every template.
const ALLOWED: [(&str, &str); 4] = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
];
const PROBE_METHODS: [&str; 7] = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"];
/// Paths as they are once normalized (what routes match on).
const PROBE_PATHS: [&str; 18] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/v1/completions?stream=true",
    "/invocations",
    "/generate",
    "/v1/completions/x",
    "/v1/completions/",
    "/v1/completion",
    "/v1/chat/completions/x",
    "/v1/embeddings",
    "/v1/models/demo-model",
    "/metrics",
    "/tokenize",
    "/V1/completions",
    "/health/x",
    "/",
];
/// The filter's `max_body_bytes` when its configuration sets none
/// (filter/src/config.rs, docs/configuration.md).
const FILTER_DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;
/// The largest `max_body_bytes` the project's own runs give the local
/// stack's envoy.yaml (the benchmarks'); the stack's default sets none.
const LOCAL_STACK_MAX_BODY_BYTES: u64 = 4 << 20;

/// Every probe: (method, path).
fn probes() -> impl Iterator<Item = (&'static str, &'static str)> {
    PROBE_METHODS
        .into_iter()
        .flat_map(|m| PROBE_PATHS.into_iter().map(move |p| (m, p)))
}

fn allowed(method: &str, path: &str) -> bool {
    let path = path.split('?').next().unwrap();
    ALLOWED.contains(&(method, path))
}

/// Every document of the templates under deploy/ (not rendered).
fn template_objects() -> Vec<(PathBuf, Value)> {
    let mut files = Vec::new();
    for dir in ["deploy/kubernetes", "deploy/envoy-gateway", "deploy/istio"] {
        yaml_files(&repo().join(dir), &mut files);
    }
    parse_documents(files)
}

fn template(kind: &str) -> Value {
    let all: Vec<Value> = template_objects()
        .into_iter()
        .filter(|(_, v)| v["kind"] == kind)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(
        all.len(),
        1,
        "expected one {kind} in deploy/, found {}",
        all.len()
    );
    all.into_iter().next().unwrap()
}

/// `envoy/envoy.yaml` with its placeholders filled in as the local stack
/// does (no `max_body_bytes` in the plugin configuration).
fn local_stack_envoy() -> Value {
    let mut text = std::fs::read_to_string(repo().join("envoy/envoy.yaml"))
        .unwrap()
        .replace("${FALLBACK_ENDPOINTS}\n", "");
    for (name, value) in [
        ("ADMIN_PORT", "1"),
        ("LISTEN_PORT", "2"),
        ("PLAIN_PORT", "3"),
        ("SIDECAR_PORT", "4"),
        ("CONTROL_PORT", "5"),
        ("WASM_PATH", "x.wasm"),
        ("PLUGIN_CONFIG", "{}"),
        ("TENANT_JWKS", "{}"),
    ] {
        text = text.replace(&format!("${{{name}}}"), value);
    }
    assert!(
        !text.contains("${"),
        "envoy/envoy.yaml has a new placeholder"
    );
    serde_norway::from_str(&text).unwrap()
}

/// The plain Deployment's Envoy configuration, from the template.
fn kubernetes_envoy() -> Value {
    let cm = template_objects()
        .into_iter()
        .map(|(_, v)| v)
        .find(|v| v["kind"] == "ConfigMap" && v["metadata"]["name"] == "kvgate-envoy-config")
        .expect("the kvgate-envoy-config ConfigMap");
    serde_norway::from_str(str_at(&cm, "/data/envoy.yaml")).unwrap()
}

/// The inference listener of an Envoy bootstrap, and its HTTP connection
/// manager's configuration.
fn inference_listener(envoy: &Value) -> (&Value, &Value) {
    let l = envoy["static_resources"]["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "kvgate_inference")
        .expect("the kvgate_inference listener");
    let hcm = l
        .pointer("/filter_chains/0/filters/0/typed_config")
        .unwrap();
    assert_eq!(
        hcm["@type"],
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    );
    (l, hcm)
}

/// Where an Envoy route table sends `method path`: `Ok(cluster)`, or
/// `Err(status)` of a direct response (404 when no route matches). Only
/// the match and action kinds the templates use are understood; anything
/// else fails the test rather than be misjudged.
fn envoy_route(routes: &Value, method: &str, path: &str, headers: &[&str]) -> Result<String, u64> {
    let path = path.split('?').next().unwrap();
    for r in routes.as_array().unwrap() {
        let m = r["match"].as_object().unwrap();
        let mut hit = true;
        for (k, v) in m {
            hit &= match k.as_str() {
                "path" => v.as_str().unwrap() == path,
                "prefix" => path.starts_with(v.as_str().unwrap()),
                "headers" => v.as_array().unwrap().iter().all(|h| {
                    let name = h["name"].as_str().unwrap();
                    if name == ":method" {
                        let exact = h.pointer("/string_match/exact").and_then(Value::as_str);
                        exact.expect("a :method match is exact") == method
                    } else if h["present_match"] == true {
                        headers.contains(&name)
                    } else {
                        panic!("header match {h} is not understood here")
                    }
                }),
                other => panic!("route match {other} is not understood here: {r}"),
            };
        }
        if !hit {
            continue;
        }
        if let Some(c) = r.pointer("/route/cluster").and_then(Value::as_str) {
            return Ok(c.to_string());
        }
        if let Some(status) = r.pointer("/direct_response/status").and_then(Value::as_u64) {
            return Err(status);
        }
        panic!("route action not understood here: {r}");
    }
    Err(404)
}

/// The plain templates' allow-list: the inference paths' POSTs to the
/// routed cluster (or, marked by the filter as failed open, to the
/// fallback), the reads to the fallback, everything else 404 from Envoy,
/// whatever the client's headers.
fn check_envoy_allow_list(name: &str, envoy: &Value) {
    let (_, hcm) = inference_listener(envoy);
    let routes = hcm
        .pointer("/route_config/virtual_hosts/0/routes")
        .unwrap_or_else(|| panic!("{name}: no inline routes"));
    assert_eq!(
        hcm["route_config"]["virtual_hosts"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "{name}: one virtual host"
    );
    for (method, path) in probes() {
        for marked in [false, true] {
            let headers: &[&str] = if marked { &["x-kvgate-fallback"] } else { &[] };
            let got = envoy_route(routes, method, path, headers);
            let want = match (method, path.split('?').next().unwrap()) {
                ("POST", "/v1/completions" | "/v1/chat/completions") if marked => {
                    Ok("kvgate_fallback".to_string())
                }
                ("POST", "/v1/completions" | "/v1/chat/completions") => {
                    Ok("kvgate_workers".to_string())
                }
                ("GET", "/v1/models" | "/health") => Ok("kvgate_fallback".to_string()),
                _ => Err(404),
            };
            assert_eq!(
                got, want,
                "{name}: {method} {path} (fail-open mark: {marked})"
            );
        }
    }
}

/// The HTTP connection manager makes one path of what the client sent
/// before any route is matched, and never forwards an escaped slash.
fn check_hcm_normalizes(name: &str, hcm: &Value) {
    assert_eq!(hcm["normalize_path"], true, "{name}: normalize_path");
    assert_eq!(hcm["merge_slashes"], true, "{name}: merge_slashes");
    let action = hcm["path_with_escaped_slashes_action"]
        .as_str()
        .unwrap_or("");
    assert!(
        ["REJECT_REQUEST", "UNESCAPE_AND_REDIRECT"].contains(&action),
        "{name}: path_with_escaped_slashes_action is {action:?}"
    );
}

/// `max_body_bytes` of a plugin configuration (JSON text or object).
fn max_body_bytes(config: &Value) -> u64 {
    let config = match config {
        Value::String(s) => serde_json::from_str(s).unwrap(),
        v => v.clone(),
    };
    config
        .get("max_body_bytes")
        .map_or(FILTER_DEFAULT_MAX_BODY_BYTES, |v| v.as_u64().unwrap())
}

fn check_buffer(name: &str, buffer: u64, max_body: u64) {
    let want = max_body + kvgate_core::disagg::DECODE_HEADROOM_BYTES as u64;
    assert!(
        buffer >= want,
        "{name}: the inference listener buffers {buffer} bytes, under max_body_bytes ({max_body}) plus the decode headroom: {want}"
    );
}

/// The router filter's plugin configuration in an Envoy listener.
fn router_plugin_config(hcm: &Value) -> Value {
    hcm["http_filters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["typed_config"]["config"]["root_id"] == ROUTER_ROOT)
        .map(|f| f["typed_config"]["config"]["configuration"]["value"].clone())
        .expect("the kvgate router filter")
}

/// A Kubernetes quantity of bytes (`4Mi`, `2097152`).
fn quantity(v: &Value) -> u64 {
    if let Some(n) = v.as_u64() {
        return n;
    }
    let s = v.as_str().unwrap();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().unwrap();
    n * match unit {
        "" => 1,
        "k" => 1000,
        "Ki" => 1 << 10,
        "M" => 1_000_000,
        "Mi" => 1 << 20,
        "G" => 1_000_000_000,
        "Gi" => 1 << 30,
        other => panic!("quantity unit {other}"),
    }
}

#[test]
fn plain_envoy_templates_route_only_the_allowed_paths_and_normalize_them() {
    for (name, envoy, max_body) in [
        (
            "envoy/envoy.yaml",
            local_stack_envoy(),
            LOCAL_STACK_MAX_BODY_BYTES,
        ),
        ("deploy/kubernetes/envoy-config.yaml", kubernetes_envoy(), 0),
    ] {
        check_envoy_allow_list(name, &envoy);
        let (listener, hcm) = inference_listener(&envoy);
        check_hcm_normalizes(name, hcm);
        let configured = max_body_bytes(&router_plugin_config(hcm));
        let buffer = listener["per_connection_buffer_limit_bytes"]
            .as_u64()
            .unwrap_or(1 << 20);
        check_buffer(name, buffer, configured.max(max_body));
    }
}

/// Which rule of an HTTPRoute takes `method path`, by Gateway API's
/// precedence (exact path over prefix, longer prefix first, a method
/// match over none); `None` when none matches.
fn gateway_api_rule<'a>(route: &'a Value, method: &str, path: &str) -> Option<&'a Value> {
    let path = path.split('?').next().unwrap();
    let mut best: Option<((u8, usize, u8), &Value)> = None;
    for rule in route["spec"]["rules"].as_array().unwrap() {
        for m in rule["matches"].as_array().unwrap() {
            for k in m.as_object().unwrap().keys() {
                assert!(
                    ["path", "method"].contains(&k.as_str()),
                    "match {k} is not understood here"
                );
            }
            let value = str_at(m, "/path/value");
            let (hit, kind) = match str_at(m, "/path/type") {
                "Exact" => (path == value, 2),
                "PathPrefix" => {
                    let v = value.trim_end_matches('/');
                    (
                        v.is_empty() || path == v || path.starts_with(&format!("{v}/")),
                        1,
                    )
                }
                other => panic!("path match {other} is not understood here"),
            };
            let by_method = m.get("method").map(|x| x.as_str().unwrap());
            if !hit || by_method.is_some_and(|x| x != method) {
                continue;
            }
            let key = (kind, value.len(), u8::from(by_method.is_some()));
            if best.is_none_or(|(k, _)| key > k) {
                best = Some((key, rule));
            }
        }
    }
    best.map(|(_, r)| r)
}

#[test]
fn envoy_gateway_routes_only_the_allowed_paths_and_normalizes_them() {
    let route = template("HTTPRoute");
    let not_found = template("HTTPRouteFilter");
    for (method, path) in probes() {
        let rule = gateway_api_rule(&route, method, path);
        let forwarded = rule.is_some_and(|r| r.get("backendRefs").is_some());
        assert_eq!(
            forwarded,
            allowed(method, path),
            "Envoy Gateway: {method} {path}"
        );
        if let Some(rule) = rule.filter(|_| !forwarded) {
            // Answered by Envoy: the direct response filter, 404.
            let f = &rule["filters"][0];
            assert_eq!(f["type"], "ExtensionRef", "{method} {path}: {rule}");
            assert_eq!(f["extensionRef"]["kind"], "HTTPRouteFilter");
            assert_eq!(f["extensionRef"]["name"], not_found["metadata"]["name"]);
        }
    }
    let direct = &not_found["spec"]["directResponse"];
    assert_eq!(direct["statusCode"], 404);
    let body: Value = serde_json::from_str(str_at(direct, "/body/inline")).unwrap();
    assert!(
        body["error"]["message"].is_string(),
        "an OpenAI-shaped error"
    );

    // One ClientTrafficPolicy on the Gateway (Envoy Gateway applies the
    // oldest of several): merged slashes, escaped slashes never forwarded
    // (Envoy Gateway always sets normalize_path), and a buffer for the
    // filter's body limit plus the decode headroom.
    let ctp = template("ClientTrafficPolicy");
    assert_eq!(ctp["spec"]["targetRefs"][0]["kind"], "Gateway");
    assert_ne!(ctp["spec"]["path"]["disableMergeSlashes"], true);
    let action = str_at(&ctp, "/spec/path/escapedSlashesAction");
    assert!(
        ["RejectRequest", "UnescapeAndRedirect"].contains(&action),
        "{action}"
    );
    let config = &template("EnvoyExtensionPolicy")["spec"]["wasm"][0]["config"];
    check_buffer(
        "deploy/envoy-gateway",
        quantity(&ctp["spec"]["connection"]["bufferLimit"]),
        max_body_bytes(config),
    );
}

/// Where an Istio VirtualService sends `method path`: `Ok(host)`, or
/// `Err(status)` of a direct response (404 when no route matches).
fn istio_route(vs: &Value, method: &str, path: &str) -> Result<String, u64> {
    let path = path.split('?').next().unwrap();
    for r in vs["spec"]["http"].as_array().unwrap() {
        let matches = r.get("match").and_then(Value::as_array);
        let hit = matches.is_none_or(|ms| {
            ms.iter().any(|m| {
                m.as_object()
                    .unwrap()
                    .iter()
                    .all(|(k, v)| match k.as_str() {
                        "uri" => match (v.get("exact"), v.get("prefix")) {
                            (Some(e), None) => e == path,
                            (None, Some(p)) => path.starts_with(p.as_str().unwrap()),
                            _ => panic!("uri match {v} is not understood here"),
                        },
                        "method" => v["exact"].as_str().expect("an exact method") == method,
                        other => panic!("match {other} is not understood here"),
                    })
            })
        });
        if !hit {
            continue;
        }
        if let Some(host) = r
            .pointer("/route/0/destination/host")
            .and_then(Value::as_str)
        {
            return Ok(host.to_string());
        }
        if let Some(status) = r.pointer("/directResponse/status").and_then(Value::as_u64) {
            return Err(status);
        }
        panic!("route action not understood here: {r}");
    }
    Err(404)
}

#[test]
fn istio_routes_only_the_allowed_paths_and_normalizes_them() {
    let vs = template("VirtualService");
    let host = str_at(&template("ServiceEntry"), "/spec/hosts/0").to_string();
    for (method, path) in probes() {
        let want = if allowed(method, path) {
            Ok(host.clone())
        } else {
            Err(404)
        };
        assert_eq!(
            istio_route(&vs, method, path),
            want,
            "Istio: {method} {path}"
        );
    }
    let last = vs["spec"]["http"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let body: Value = serde_json::from_str(str_at(&last, "/directResponse/body/string")).unwrap();
    assert!(
        body["error"]["message"].is_string(),
        "an OpenAI-shaped error"
    );

    // The EnvoyFilter patches the gateway's connection manager and
    // listener on the Gateway's port.
    let gateway = template_objects()
        .into_iter()
        .map(|(_, v)| v)
        .find(|v| v["kind"] == "Gateway" && v["apiVersion"] == "networking.istio.io/v1")
        .expect("Istio's Gateway");
    let port = gateway["spec"]["servers"][0]["port"]["number"].clone();
    let filter = template("EnvoyFilter");
    let patches = filter["spec"]["configPatches"].as_array().unwrap();
    let on_port = |apply_to: &str| -> Value {
        let found: Vec<&Value> = patches
            .iter()
            .filter(|p| p["applyTo"] == apply_to && p["match"]["listener"]["portNumber"] == port)
            .collect();
        assert_eq!(found.len(), 1, "one {apply_to} patch on port {port}");
        assert_eq!(found[0]["match"]["context"], "GATEWAY");
        assert_eq!(found[0]["patch"]["operation"], "MERGE");
        found[0]["patch"]["value"].clone()
    };
    let hcm = on_port("NETWORK_FILTER");
    check_hcm_normalizes("deploy/istio", &hcm["typed_config"]);
    let listener = on_port("LISTENER");
    let config = &template("WasmPlugin")["spec"]["pluginConfig"];
    check_buffer(
        "deploy/istio",
        listener["per_connection_buffer_limit_bytes"]
            .as_u64()
            .unwrap(),
        max_body_bytes(config),
    );
}
