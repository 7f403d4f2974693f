//! Library-level suites: executors (local, Docker, Kubernetes, WASM, plugins) against the conformance kit, the
//! turn loop in-process against the scripted server over real HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod docker_executor;
mod docker_hosts;
mod egress;
mod hostile;
mod kubernetes;
mod local_executor;
mod plugin_executor;
mod store;
mod store_kit;
mod teams;
mod tools;
mod turn_loop;
mod wasm_executor;
