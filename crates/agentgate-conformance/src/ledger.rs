//! A ledger table written inside a tool's SQL transaction, and its row count.
//!
//! The table has no unique key on purpose: a double booking must show up as a
//! second row, not be hidden by a constraint.

use agentgate::store::BoxFuture;
use agentgate::{BoxError, SqlTx};
use serde_json::{json, Value};
use sqlx::Connection;

/// Creates the ledger table in the target's database.
///
/// # Panics
/// When the database cannot be reached: the target was made to be reachable.
pub async fn prepare(store_url: &str) {
    let ddl = "CREATE TABLE IF NOT EXISTS conformance_ledger (entry_key VARCHAR(128) NOT NULL, amount BIGINT NOT NULL)";
    execute(store_url, ddl).await;
}

async fn execute(store_url: &str, sql: &str) {
    match scheme(store_url) {
        "sqlite" => {
            let mut conn = sqlx::SqliteConnection::connect(store_url)
                .await
                .expect("connect sqlite");
            sqlx::query(sql)
                .execute(&mut conn)
                .await
                .expect("ledger ddl");
        }
        "postgres" | "postgresql" => {
            let mut conn = sqlx::PgConnection::connect(store_url)
                .await
                .expect("connect");
            sqlx::query(sql)
                .execute(&mut conn)
                .await
                .expect("ledger ddl");
        }
        "mysql" | "mariadb" => {
            let mut conn = sqlx::MySqlConnection::connect(store_url)
                .await
                .expect("connect");
            sqlx::query(sql)
                .execute(&mut conn)
                .await
                .expect("ledger ddl");
        }
        other => panic!("no ledger for store scheme {other}"),
    }
}

fn scheme(url: &str) -> &str {
    url.split(':').next().unwrap_or_default()
}

/// Rows booked under `entry_key`.
///
/// # Panics
/// When the database cannot be reached.
pub async fn count(store_url: &str, entry_key: &str) -> i64 {
    let sql = "SELECT COUNT(*) FROM conformance_ledger WHERE entry_key = ?";
    match scheme(store_url) {
        "sqlite" => {
            let mut conn = sqlx::SqliteConnection::connect(store_url)
                .await
                .expect("connect sqlite");
            sqlx::query_scalar(sql)
                .bind(entry_key)
                .fetch_one(&mut conn)
                .await
                .expect("count ledger")
        }
        "postgres" | "postgresql" => {
            let mut conn = sqlx::PgConnection::connect(store_url)
                .await
                .expect("connect");
            sqlx::query_scalar("SELECT COUNT(*) FROM conformance_ledger WHERE entry_key = $1")
                .bind(entry_key)
                .fetch_one(&mut conn)
                .await
                .expect("count ledger")
        }
        "mysql" | "mariadb" => {
            let mut conn = sqlx::MySqlConnection::connect(store_url)
                .await
                .expect("connect");
            sqlx::query_scalar(sql)
                .bind(entry_key)
                .fetch_one(&mut conn)
                .await
                .expect("count ledger")
        }
        other => panic!("no ledger for store scheme {other}"),
    }
}

/// Books `amount` under `entry_key` in the tool's transaction; with
/// `fail_after` the effect errors *after* writing, so the rollback is tested.
pub fn book(
    entry_key: String,
    amount: i64,
    fail_after: bool,
) -> impl for<'c> FnOnce(SqlTx<'c>) -> BoxFuture<'c, Result<Value, BoxError>> + Send {
    move |tx: SqlTx<'_>| {
        Box::pin(async move {
            let sql = "INSERT INTO conformance_ledger (entry_key, amount) VALUES (?, ?)";
            match tx {
                SqlTx::Sqlite(conn) => {
                    sqlx::query(sql)
                        .bind(&entry_key)
                        .bind(amount)
                        .execute(conn)
                        .await?;
                }
                SqlTx::Postgres(conn) => {
                    sqlx::query(
                        "INSERT INTO conformance_ledger (entry_key, amount) VALUES ($1, $2)",
                    )
                    .bind(&entry_key)
                    .bind(amount)
                    .execute(conn)
                    .await?;
                }
                SqlTx::MySql(conn) => {
                    sqlx::query(sql)
                        .bind(&entry_key)
                        .bind(amount)
                        .execute(conn)
                        .await?;
                }
                other => return Err(format!("no ledger for {other:?}").into()),
            }
            if fail_after {
                return Err("forced failure after the effect".into());
            }
            Ok(json!({"booked": entry_key, "amount": amount}))
        }) as BoxFuture<'_, Result<Value, BoxError>>
    }
}
