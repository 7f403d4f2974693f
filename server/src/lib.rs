//! Tandem as a service: the durable task store, the supervisor that runs queued tasks, and
//! the HTTP API that clients reach over a Unix socket or TCP.

mod admission;
pub mod api;
pub mod approvals;
pub mod error;
pub mod files;
pub mod follow;
pub mod mcp;
pub mod metrics;
mod openai;
pub mod plan;
pub mod policy;
pub mod ports;
mod running;
pub mod sandbox;
pub mod serve;
mod sink;
pub mod store;
pub mod supervisor;
pub mod web;
mod writer;

pub use error::TaskError;
pub use plan::{NetworkConfig, Planner, PlannerConfig, TaskDefaults};
pub use policy::{Endpoint, Policy};
pub use serve::{ConnLimits, Listeners, bind_unix, serve};
pub use store::{PgStore, Store, StoreError, TaskRecord, TaskState, TaskStore};
pub use supervisor::{Supervisor, SupervisorConfig};
pub use writer::now_ms;
