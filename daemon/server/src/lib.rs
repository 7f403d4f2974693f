//! Tandem as a service: the durable task store, the supervisor that runs queued tasks, and
//! the HTTP API that clients reach over a Unix socket or TCP.

pub mod store;

pub use store::{Store, StoreError, TaskRecord, TaskState};
