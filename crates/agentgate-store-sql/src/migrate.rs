//! Schema migrations, applied the same way on every store: the version
//! table created if absent, then every migration newer than its highest
//! version run and recorded, in order, on the connection the store chose
//! (inside its transaction or under its lock).

/// Applies `migrations` (`&[(version, sql)]`, ascending) newer than the
/// highest version in `ag_schema_version` on `conn` (`&mut` a sqlx
/// connection or transaction): `create` makes the version table if absent,
/// `record` inserts one version (its one placeholder); `errors` maps the
/// driver's errors. A macro, not a function, so each store's driver types
/// are its own.
#[macro_export]
macro_rules! apply_migrations {
    ($conn:expr, $migrations:expr, create = $create:expr, record = $record:expr, errors = $map_err:path $(,)?) => {{
        let conn = $conn;
        async {
            ::sqlx::raw_sql($create)
                .execute(&mut *conn)
                .await
                .map_err($map_err)?;
            let current: Option<i64> =
                ::sqlx::query_scalar("SELECT MAX(version) FROM ag_schema_version")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err($map_err)?;
            let current = current.unwrap_or(0);
            for (version, sql) in $migrations.iter().filter(|(v, _)| *v > current) {
                ::sqlx::raw_sql(sql)
                    .execute(&mut *conn)
                    .await
                    .map_err($map_err)?;
                ::sqlx::query($record)
                    .bind(version)
                    .execute(&mut *conn)
                    .await
                    .map_err($map_err)?;
                ::tracing::info!(version, "applied agentgate schema migration");
            }
            ::agentgate_core::error::Result::Ok(())
        }
        .await
    }};
}
