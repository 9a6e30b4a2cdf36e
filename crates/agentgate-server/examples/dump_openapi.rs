//! Prints the OpenAPI 3.1 document, for client generators:
//! `cargo run -p agentgate-server --example dump_openapi > openapi.json`.
#![forbid(unsafe_code)]

fn main() {
    println!("{}", agentgate_server::openapi::document_json());
}
