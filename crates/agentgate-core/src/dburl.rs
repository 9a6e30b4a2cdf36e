//! Small, pure edits of a database server URL (`scheme://user:pass@host/db?…`)
//! that the stores' test helpers and the conformance command share.

/// `url` without its password, for messages: `postgres://u:secret@h/db`
/// reads `postgres://u@h/db`.
pub fn redact_password(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}@{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// `url` with its database (the path) replaced by `database`, its query kept.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{database}", &base[..path_start]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_dropped_and_the_rest_kept() {
        assert_eq!(
            redact_password("postgres://u:secret@h:5432/db?sslmode=require"),
            "postgres://u@h:5432/db?sslmode=require"
        );
        assert_eq!(
            redact_password("mysql://root@h/test"),
            "mysql://root@h/test"
        );
        assert_eq!(redact_password("sqlite://file.db"), "sqlite://file.db");
    }

    #[test]
    fn the_database_is_replaced_and_the_query_kept() {
        assert_eq!(
            with_database("postgres://u@h:5432/postgres?sslmode=require", "scratch"),
            "postgres://u@h:5432/scratch?sslmode=require"
        );
        assert_eq!(
            with_database("mysql://root@h:3306", "scratch"),
            "mysql://root@h:3306/scratch"
        );
    }
}
