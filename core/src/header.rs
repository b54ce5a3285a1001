//! Header names the front doors, the sidecar and Envoy agree on. The
//! routing ones are the defaults of settings (`destination_header` and the
//! like); the others are fixed.

/// Where Envoy's override-host balancer reads the chosen worker from
/// (the Gateway API inference extension's name).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The chosen data-parallel rank (vLLM's name).
pub const RANK: &str = "x-data-parallel-rank";
/// The runner-up Envoy retries on when the chosen worker refuses.
pub const FALLBACK: &str = "x-kvgate-fallback";
/// The request's tenant, set by authentication in front of the router.
pub const TENANT: &str = "x-kvgate-tenant";
/// The request's priority class, set by Envoy from the route, a JWT claim
/// or the tenant, never by the client (admission strips nothing itself).
pub const CLASS: &str = "x-kvgate-class";
/// Whose share of a contended model's load a request counts against (a
/// tenant of a shared pool), set by Envoy from authentication.
pub const ACCOUNT: &str = "x-kvgate-account";
/// A client asking to be shed at once rather than held, where the
/// operator allows it.
pub const DO_NOT_QUEUE: &str = "x-kvgate-do-not-queue";
/// The host a disaggregated request's prefill callout goes to: read by
/// the prefill cluster's override-host balancer. Only the filter sets it,
/// on a callout, which carries no client header.
pub const PREFILL_HOST: &str = "x-kvgate-prefill-host";
/// The id both legs of a disaggregated request carry (the KV handoff is
/// keyed by it), minted by kvgate in place of any client's.
pub const REQUEST_ID: &str = "x-request-id";
/// Response header naming the worker and rank that served the request.
pub const SERVED_BY: &str = "x-kvgate-served-by";
/// Response header saying where a request of a model that pulls was
/// placed: `holder`, `recompute; blocks=N` or `pull; blocks=N;
/// transfer_ms=T` ([`crate::disagg::pull::Placed::header_value`]).
pub const PLACEMENT: &str = "x-kvgate-placement";
/// Why kvgate answered a request itself ([`crate::reply::Reason`]).
pub const REASON: &str = "x-kvgate-reason";
/// The snapshot version of a sidecar's poll answer.
pub const VERSION: &str = "x-kvgate-version";
/// The sidecar's epoch in its poll answers: a new one means it restarted.
pub const EPOCH: &str = "x-kvgate-epoch";
/// Envoy's count of upstream attempts, in the response when the virtual
/// host sets `include_attempt_count_in_response`.
pub const ATTEMPT_COUNT: &str = "x-envoy-attempt-count";
pub const RETRY_AFTER: &str = "retry-after";
pub const CONTENT_TYPE: &str = "content-type";
