//! End-to-end suites: the real `tandem` binary, real HTTP to a scripted model server, real
//! processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod answers;
mod approval;
mod budgets;
mod daemon;
mod docker_hosts;
mod e2e;
mod embedded;
mod eval;
mod files;
mod hostile;
mod hostile_clients;
mod kept;
mod kubernetes;
mod limits;
mod mcp;
mod new_user;
mod plugins;
mod python;
mod shared_store;
mod teams;
mod tools;
mod traces;
mod web;
mod zoo;
