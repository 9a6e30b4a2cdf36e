-- agentgate schema v6 (PostgreSQL): the common begin in one statement.
--
-- ag_begin_new grants a NEW turn (attempt 1) when, read under the begin's
-- locks, nothing but a start can come of it: the request has no turn yet,
-- the session is free (no holder at all, no pending confirmation) and
-- belongs to the caller or does not exist yet, and the user's live permits
-- are below its cap. It returns the grant's fence, or NULL ("fall back"):
-- the caller then runs the full read-decide-write begin, which makes the
-- real decision. It never refuses by itself, and a NULL answer has written
-- nothing: the rows a first use created for the locks are deleted again
-- (see below). The caller never calls it with a confirmation or a lease
-- layer; src/begin.rs maps each condition to decide_begin's answer.
--
-- Locks and snapshots are the full path's: the user's row, then the
-- session's row (each created on first use), and the facts read by
-- statements that run after both locks are held. A VOLATILE function (the
-- default) takes a fresh snapshot for each statement it runs: "STABLE and
-- IMMUTABLE functions use a snapshot established as of the start of the
-- calling query, whereas VOLATILE functions obtain a fresh snapshot at the
-- start of each query they execute" (PostgreSQL manual, "Function
-- Volatility Categories", https://www.postgresql.org/docs/current/xfunc-volatility.html).
-- So under READ COMMITTED the permit count and the turn lookup see every
-- grant and turn that committed while this call waited for the locks, as
-- the full path's separate facts statement does. SELECT ... FOR UPDATE
-- returns the newest version of a row it waited for.
--
-- The clock is read once, after the locks, into v_now_ms: statement_timestamp()
-- is the time the client's command arrived (stale by the lock waits), and
-- clock_timestamp() changes while a statement runs, so one reading is used
-- for the liveness test and the expiry alike.
--
-- A refusal writes nothing. The hot path must not pay for that: a PL/pgSQL
-- block with an EXCEPTION clause starts a subtransaction on every call, and
-- raising an error to the client would log an ERROR for every busy session.
-- Instead the rare fallback after a first use deletes the rows this same
-- call inserted (uncommitted, locked by it, seen by no one), so the commit
-- leaves the tables as they were.
--
-- Parameters: the session, user and request ids; the new turn's id, the
-- lease token's digest, the request's fingerprint and payload; the lease
-- TTL; the configured cap (for a user row without its own); the step's lock
-- timeout (the full path's SET LOCAL lock_timeout, here for this call's
-- implicit transaction only).
CREATE FUNCTION ag_begin_new(
    p_session_id TEXT,
    p_user_id TEXT,
    p_client_request_id TEXT,
    p_turn_id TEXT,
    p_token_hash TEXT,
    p_fingerprint TEXT,
    p_payload TEXT,
    p_lease_ttl_ms BIGINT,
    p_default_cap BIGINT,
    p_lock_timeout TEXT
) RETURNS BIGINT
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_user_created BOOLEAN := FALSE;
    v_session_created BOOLEAN := FALSE;
    v_cap BIGINT;
    v_owner TEXT;
    v_holder TEXT;
    v_pending TEXT;
    v_now_ms BIGINT;
    v_fence BIGINT;
BEGIN
    -- A begin whose rows already rule the common case out (a repeat of a
    -- request, a held session: a storm of them) falls back before taking
    -- any lock, so it neither queues for the user's row twice nor commits
    -- a transaction. Read without locks, this only ever falls back; the
    -- grant rests on the same checks repeated under the locks.
    IF EXISTS (SELECT 1 FROM ag_turns
               WHERE session_id = p_session_id AND client_request_id = p_client_request_id)
        OR EXISTS (SELECT 1 FROM ag_sessions
                   WHERE session_id = p_session_id AND (user_id <> p_user_id
                     OR holder_turn_id IS NOT NULL OR pending_turn_id IS NOT NULL))
    THEN
        RETURN NULL;
    END IF;

    PERFORM set_config('lock_timeout', p_lock_timeout, TRUE);

    -- The user's row, locked (created on first use).
    SELECT max_turns INTO v_cap FROM ag_users WHERE user_id = p_user_id FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ag_users (user_id) VALUES (p_user_id) ON CONFLICT (user_id) DO NOTHING;
        IF NOT FOUND THEN
            -- Another begin created it meanwhile: no lock held, nothing
            -- written (the commit need not wait, as below).
            PERFORM set_config('synchronous_commit', 'off', TRUE);
            RETURN NULL;
        END IF;
        v_user_created := TRUE;
    END IF;

    -- Then the session's row, locked (created on first use, bound to the caller).
    SELECT user_id, holder_turn_id, pending_turn_id INTO v_owner, v_holder, v_pending
        FROM ag_sessions WHERE session_id = p_session_id FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms)
            VALUES (p_session_id, p_user_id, 0,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT)
            ON CONFLICT (session_id) DO NOTHING;
        IF FOUND THEN
            v_session_created := TRUE;
            v_owner := p_user_id;
        END IF;
    END IF;

    v_now_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;

    -- Every condition of a new start; anything else falls back. A cap
    -- outside 0..=u32::MAX is corrupt: the full path reports it.
    IF v_owner IS NULL  -- the session was created meanwhile by another begin
        OR v_owner <> p_user_id
        OR v_holder IS NOT NULL
        OR v_pending IS NOT NULL
        OR v_cap < 0 OR v_cap > 4294967295
        OR EXISTS (SELECT 1 FROM ag_turns
                   WHERE session_id = p_session_id AND client_request_id = p_client_request_id)
        OR (SELECT COUNT(*) FROM ag_sessions
            WHERE user_id = p_user_id AND lease_expires_at_ms > v_now_ms)
           >= COALESCE(v_cap, p_default_cap)
    THEN
        IF v_session_created THEN
            DELETE FROM ag_sessions WHERE session_id = p_session_id;
        END IF;
        IF v_user_created THEN
            DELETE FROM ag_users WHERE user_id = p_user_id;
        END IF;
        -- Nothing of this transaction matters (its row locks, an insert
        -- deleted again), so its commit need not wait for the WAL flush
        -- while the user's row stays locked: were it lost in a crash, the
        -- tables would read the same.
        PERFORM set_config('synchronous_commit', 'off', TRUE);
        RETURN NULL;
    END IF;

    -- The grant (the full path's statement for a new turn without a
    -- confirmation): holder, token digest, a fence from the sequence and
    -- the expiry on the session's row, then the turn under that fence.
    UPDATE ag_sessions SET holder_turn_id = p_turn_id, lease_token_hash = p_token_hash,
        fence = nextval('ag_fence_seq'), lease_expires_at_ms = v_now_ms + p_lease_ttl_ms,
        updated_at_ms = v_now_ms
        WHERE session_id = p_session_id
        RETURNING fence INTO STRICT v_fence;
    INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint,
        state, attempt, fence, created_at_ms, updated_at_ms, payload)
        VALUES (p_turn_id, p_session_id, p_user_id, p_client_request_id, p_fingerprint,
        'running', 1, v_fence, v_now_ms, v_now_ms, p_payload);
    RETURN v_fence;
END;
$$;
