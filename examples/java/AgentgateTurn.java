// One agent turn against `agentgate serve`, with the JDK alone (Java 17+):
// begin → heartbeat in the background → claim the tool `book_expense` → run
// it only when `execute` is true (after a crash: look its idempotency key up
// in the ledger first) → complete the execution → complete the turn.
//
//   java examples/java/AgentgateTurn.java --url http://127.0.0.1:7700 \
//       --ledger /tmp/ledger.txt --message-id msg-1 [--text 'taxi 18'] \
//       [--user alice] [--session chat-1] [--think-ms 0] [--crash-after-effect]
//
// --think-ms stands in for the LLM's time before it calls the tool;
// --crash-after-effect halts the JVM right after the booking, before the
// server hears of it (the case the reconcile step is for).
//
// The ledger is the "downstream system": a text file of lines
// `idempotency_key<TAB>amount`, appended and fsynced. It does not deduplicate
// by itself; that a message books at most once is agentgate's doing.
// The last line on stdout is one JSON object: the outcome, response last.

import java.io.IOException;
import java.math.BigDecimal;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpRequest.BodyPublishers;
import java.net.http.HttpResponse;
import java.net.http.HttpResponse.BodyHandlers;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class AgentgateTurn {
    /** How often a begin answered 409 request_in_flight / 429 is repeated before giving up. */
    static final int MAX_BEGIN_WAITS = 20;
    /** How often a claim answered 409 tool_in_flight is repeated before giving up. */
    static final int MAX_TOOL_IN_FLIGHT_WAITS = 10;
    /** The longest wait for one answer; the server answers within 30 s even when its store is down. */
    static final Duration REQUEST_TIMEOUT = Duration.ofSeconds(35);
    /** The longest single sleep on a Retry-After, whatever the server says. */
    static final long MAX_RETRY_AFTER_SECONDS = 30;
    /** The begin errors that mean "repeat it after Retry-After"; session_busy is for the user to see. */
    static final List<String> RETRYABLE_BEGIN_ERRORS =
            List.of("request_in_flight", "user_at_capacity", "store_unavailable", "overloaded");
    /** How often the simulated LLM work looks whether the lease is lost. */
    static final long THINK_SLICE_MS = 50;

    /** Thrown when the lease is gone: stop working on the turn at once. */
    static final class LeaseLost extends RuntimeException {
        private static final long serialVersionUID = 1L;

        LeaseLost(String message) { super(message); }
    }

    final HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
    final String base;
    final AtomicBoolean leaseLost = new AtomicBoolean(false);
    /** What happened to the tool call: executed, reconciled (found in the ledger) or stored (not run again). */
    String toolOutcome;

    AgentgateTurn(String base) { this.base = base.replaceAll("/+$", ""); }

    record Reply(int status, Map<String, Object> body, long retryAfterSeconds) {
        String errorCode() {
            Object error = body.get("error");
            return error instanceof Map<?, ?> e ? (String) e.get("code") : null;
        }
    }

    Reply post(String path, String leaseToken, Map<String, Object> body) throws IOException, InterruptedException {
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(base + path)).timeout(REQUEST_TIMEOUT);
        if (leaseToken != null) request.header("Lease-Token", leaseToken);
        if (body != null) {
            request.header("Content-Type", "application/json").POST(BodyPublishers.ofString(Json.write(body)));
        } else {
            request.POST(BodyPublishers.noBody());
        }
        HttpResponse<String> r = http.send(request.build(), BodyHandlers.ofString(StandardCharsets.UTF_8));
        Map<String, Object> parsed = r.body().isEmpty() ? Map.of() : map(Json.read(r.body()));
        long retryAfter = r.headers().firstValueAsLong("Retry-After").orElse(1);
        return new Reply(r.statusCode(), parsed, Math.min(Math.max(retryAfter, 1), MAX_RETRY_AFTER_SECONDS));
    }

    /** Begins the turn; waits (bounded) while the same request runs elsewhere or the user is at capacity. */
    Reply begin(String user, String session, String messageId, Map<String, Object> payload) throws Exception {
        for (int waits = 0; waits < MAX_BEGIN_WAITS; waits++) {
            Reply r = post("/v1/turns", null, obj("user_id", user, "session_id", session,
                    "client_request_id", messageId, "payload", payload));
            if (r.status == 200 || r.status == 201) return r;
            // request_in_flight, user_at_capacity: the holder's remaining lease; a 503: when the
            // server looks again. Repeating a begin with the same client_request_id is safe.
            if (RETRYABLE_BEGIN_ERRORS.contains(r.errorCode())) {
                Thread.sleep(r.retryAfterSeconds * 1000);
                continue;
            }
            throw new IllegalStateException("begin: " + r.status + " " + Json.write(r.body)); // session_busy: tell the user
        }
        throw new IllegalStateException("begin: still in flight after " + MAX_BEGIN_WAITS + " waits");
    }

    /** Posts a heartbeat every third of the lease; a 409 lease_lost sets leaseLost and stops. */
    ScheduledExecutorService heartbeat(String turnId, String token, long leaseMs) {
        ScheduledExecutorService timer = Executors.newSingleThreadScheduledExecutor(r -> {
            Thread t = new Thread(r, "heartbeat");
            t.setDaemon(true);
            return t;
        });
        long periodMs = Math.max(leaseMs / 3, 1);
        timer.scheduleAtFixedRate(() -> {
            try {
                Reply r = post("/v1/turns/" + turnId + "/heartbeat", token, null);
                if (r.status == 409) {
                    leaseLost.set(true);
                    timer.shutdown();
                }
            } catch (Exception e) {
                System.err.println("heartbeat: " + e);   // a missed beat; the next one may get through
            }
        }, periodMs, periodMs, TimeUnit.MILLISECONDS);
        return timer;
    }

    void checkLease(Reply r, String step) {
        if (leaseLost.get() || "lease_lost".equals(r.errorCode())) throw new LeaseLost(step + ": lease lost");
        if (r.status >= 300) throw new IllegalStateException(step + ": " + r.status + " " + Json.write(r.body));
    }

    /** The LLM's work: thinkMs of it, in slices, stopping as soon as the lease is lost. */
    void think(long thinkMs) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(thinkMs);
        while (System.nanoTime() < deadline) {
            if (leaseLost.get()) throw new LeaseLost("think: lease lost");
            Thread.sleep(Math.min(THINK_SLICE_MS, Math.max(1, TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime()))));
        }
    }

    /** Runs a begun (201) turn to its end and returns the completed turn. */
    Map<String, Object> runTurn(Map<String, Object> turn, String text, Ledger ledger, long thinkMs,
            boolean crashAfterEffect) throws Exception {
        String turnId = (String) turn.get("turn_id");
        String token = (String) turn.get("lease_token");
        ScheduledExecutorService timer = heartbeat(turnId, token, ((Number) turn.get("lease_expires_in_ms")).longValue());
        try {
            think(thinkMs);
            BigDecimal amount = readAmount(text);   // the offline "LLM": the first number in the message
            Map<String, Object> args = obj("amount", amount, "text", text);
            Reply claim = null;
            for (int waits = 0; waits <= MAX_TOOL_IN_FLIGHT_WAITS; waits++) {
                claim = post("/v1/turns/" + turnId + "/tools", token, obj("tool", "book_expense", "args", args));
                if (!"tool_in_flight".equals(claim.errorCode())) break;
                Thread.sleep(claim.retryAfterSeconds * 1000);
            }
            checkLease(claim, "claim");
            Map<String, Object> execution = map(claim.body.get("execution"));
            Object entry;
            if (Boolean.TRUE.equals(claim.body.get("execute"))) {
                String key = (String) execution.get("idempotency_key");
                Map<String, Object> found = "unknown".equals(execution.get("previous_outcome")) ? ledger.find(key) : null;
                if (found != null) {
                    entry = found;   // the crashed attempt booked it: do not book again
                    toolOutcome = "reconciled";
                } else {
                    entry = ledger.book(key, amount);
                    toolOutcome = "executed";
                    if (crashAfterEffect) Runtime.getRuntime().halt(137);   // the effect is taken, the server not told
                }
                String executionId = (String) execution.get("execution_id");
                checkLease(post("/v1/turns/" + turnId + "/tools/" + executionId + "/complete", token,
                        obj("result", entry)), "complete execution");
            } else {
                entry = execution.get("result");   // booked by an earlier attempt: do not run it again
                toolOutcome = "stored";
            }
            Reply done = post("/v1/turns/" + turnId + "/complete", token,
                    obj("response", obj("text", "Booked " + amount + " for: " + text, "entry", entry)));
            checkLease(done, "complete turn");
            return map(done.body.get("turn"));
        } catch (LeaseLost e) {
            throw e;   // someone else owns the turn now: send nothing more
        } catch (Exception e) {
            post("/v1/turns/" + turnId + "/fail", token, obj("error", e.toString(), "retryable", true));
            throw e;
        } finally {
            timer.shutdownNow();
        }
    }

    static BigDecimal readAmount(String text) {
        Matcher m = Pattern.compile("\\d+(\\.\\d+)?").matcher(text);
        if (!m.find()) throw new IllegalArgumentException("no amount in " + Json.write(text));
        return new BigDecimal(m.group());
    }

    /** The downstream system: `key<TAB>amount` lines, each appended in one write and fsynced. */
    record Ledger(Path path) {
        Map<String, Object> book(String key, BigDecimal amount) throws IOException {
            byte[] line = (key + "\t" + amount.toPlainString() + "\n").getBytes(StandardCharsets.UTF_8);
            try (FileChannel f = FileChannel.open(path, StandardOpenOption.CREATE, StandardOpenOption.WRITE,
                    StandardOpenOption.APPEND)) {
                ByteBuffer buffer = ByteBuffer.wrap(line);
                while (buffer.hasRemaining()) f.write(buffer);
                f.force(true);
            }
            return obj("idempotency_key", key, "amount", amount);
        }

        Map<String, Object> find(String key) throws IOException {
            List<String> lines;
            try {
                lines = Files.readAllLines(path, StandardCharsets.UTF_8);
            } catch (NoSuchFileException e) {
                return null;
            }
            for (String line : lines) {
                String[] fields = line.split("\t", 2);
                if (fields.length == 2 && fields[0].equals(key)) {
                    return obj("idempotency_key", key, "amount", new BigDecimal(fields[1]));
                }
            }
            return null;
        }
    }

    public static void main(String[] argv) throws Exception {
        if (argv.length == 1 && argv[0].equals("--json-roundtrip")) {   // the codec's check in test.sh
            String input = new String(System.in.readAllBytes(), StandardCharsets.UTF_8);
            for (String line : input.split("\n")) {   // one document a line: re-encoded, or why it is refused
                try {
                    System.out.println(Json.write(Json.read(line)));
                } catch (IllegalArgumentException e) {
                    System.out.println("refused: " + e.getMessage());
                }
            }
            return;
        }
        Map<String, String> flags = new HashMap<>(Map.of("--user", "alice", "--session", "chat-1",
                "--text", "taxi 18 yesterday", "--think-ms", "0"));
        boolean crashAfterEffect = false;
        for (int i = 0; i < argv.length; i++) {
            if (argv[i].equals("--crash-after-effect")) crashAfterEffect = true;
            else if (argv[i].startsWith("--") && i + 1 < argv.length) flags.put(argv[i], argv[++i]);
            else throw new IllegalArgumentException("unknown argument " + argv[i]);
        }
        for (String required : List.of("--url", "--ledger", "--message-id")) {
            if (!flags.containsKey(required)) throw new IllegalArgumentException("missing " + required);
        }
        AgentgateTurn client = new AgentgateTurn(flags.get("--url"));
        String text = flags.get("--text");
        Reply begun = client.begin(flags.get("--user"), flags.get("--session"), flags.get("--message-id"),
                obj("text", text));
        Map<String, Object> turn = map(begun.body.get("turn"));
        Map<String, Object> outcome = new LinkedHashMap<>();
        outcome.put("turn_id", turn.get("turn_id"));
        if (begun.status == 200) {
            outcome.put("outcome", "replayed");   // a retry: the stored answer, no second LLM call or booking
        } else {
            outcome.put("outcome", "completed");
            outcome.put("takeover", turn.get("takeover"));
            System.err.println("begun " + turn.get("turn_id") + " attempt " + turn.get("attempt"));
            try {
                turn = client.runTurn(turn, text, new Ledger(Path.of(flags.get("--ledger"))),
                        Long.parseLong(flags.get("--think-ms")), crashAfterEffect);
                outcome.put("tool", client.toolOutcome);
            } catch (LeaseLost e) {
                outcome.put("outcome", "lease_lost");
                System.out.println(Json.write(outcome));
                System.exit(3);
            }
        }
        outcome.put("response", turn.get("response"));
        System.out.println(Json.write(outcome));
    }

    static Map<String, Object> obj(Object... keysAndValues) {
        Map<String, Object> m = new LinkedHashMap<>();
        for (int i = 0; i < keysAndValues.length; i += 2) m.put((String) keysAndValues[i], keysAndValues[i + 1]);
        return m;
    }

    @SuppressWarnings("unchecked")
    static Map<String, Object> map(Object value) {
        if (!(value instanceof Map)) throw new IllegalStateException("expected a JSON object, got " + Json.write(value));
        return (Map<String, Object>) value;
    }

    /** JSON (RFC 8259) to and from Map/List/String/BigDecimal/Long/Boolean/null. */
    static final class Json {
        /** Deeper nesting is refused rather than overflowing the stack. */
        static final int MAX_DEPTH = 128;

        static String write(Object value) {
            StringBuilder out = new StringBuilder();
            write(value, out);
            return out.toString();
        }

        static void write(Object value, StringBuilder out) {
            if (value == null) out.append("null");
            else if (value instanceof String s) writeString(s, out);
            else if (value instanceof Boolean b) out.append(b);
            else if (value instanceof BigDecimal d) out.append(d.toString());
            else if (value instanceof Long || value instanceof Integer) out.append(value);
            else if (value instanceof Double d) {
                if (d.isNaN() || d.isInfinite()) throw new IllegalArgumentException("JSON has no " + d);
                out.append(BigDecimal.valueOf(d));
            } else if (value instanceof Map<?, ?> m) {
                out.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : m.entrySet()) {
                    if (!first) out.append(',');
                    first = false;
                    writeString((String) e.getKey(), out);
                    out.append(':');
                    write(e.getValue(), out);
                }
                out.append('}');
            } else if (value instanceof List<?> l) {
                out.append('[');
                for (int i = 0; i < l.size(); i++) {
                    if (i > 0) out.append(',');
                    write(l.get(i), out);
                }
                out.append(']');
            } else throw new IllegalArgumentException("not JSON: " + value.getClass());
        }

        static void writeString(String s, StringBuilder out) {
            out.append('"');
            for (int i = 0; i < s.length(); i++) {
                char c = s.charAt(i);
                switch (c) {
                    case '"' -> out.append("\\\"");
                    case '\\' -> out.append("\\\\");
                    case '\n' -> out.append("\\n");
                    case '\r' -> out.append("\\r");
                    case '\t' -> out.append("\\t");
                    case '\b' -> out.append("\\b");
                    case '\f' -> out.append("\\f");
                    default -> {
                        if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
                        else out.append(c);   // other characters as they are: the body is UTF-8
                    }
                }
            }
            out.append('"');
        }

        static Object read(String text) {
            Json parser = new Json(text);
            parser.skipSpace();
            Object value = parser.value(0);
            parser.skipSpace();
            if (parser.at < text.length()) throw parser.error("trailing characters");
            return value;
        }

        final String text;
        int at = 0;

        Json(String text) { this.text = text; }

        IllegalArgumentException error(String what) {
            return new IllegalArgumentException("JSON: " + what + " at offset " + at);
        }

        void skipSpace() {
            while (at < text.length() && " \t\r\n".indexOf(text.charAt(at)) >= 0) at++;
        }

        char peek() {
            if (at >= text.length()) throw error("unexpected end");
            return text.charAt(at);
        }

        void expect(char c) {
            if (peek() != c) throw error("expected '" + c + "'");
            at++;
        }

        Object value(int depth) {
            if (depth > MAX_DEPTH) throw error("nested deeper than " + MAX_DEPTH);
            char c = peek();
            if (c == '{') return object(depth);
            if (c == '[') return array(depth);
            if (c == '"') return string();
            if (c == '-' || (c >= '0' && c <= '9')) return number();
            for (String word : List.of("true", "false", "null")) {
                if (text.startsWith(word, at)) {
                    at += word.length();
                    return word.equals("null") ? null : Boolean.valueOf(word);
                }
            }
            throw error("unexpected character '" + c + "'");
        }

        Map<String, Object> object(int depth) {
            Map<String, Object> m = new LinkedHashMap<>();
            expect('{');
            skipSpace();
            if (peek() == '}') { at++; return m; }
            while (true) {
                skipSpace();
                String key = string();
                skipSpace();
                expect(':');
                skipSpace();
                m.put(key, value(depth + 1));
                skipSpace();
                if (peek() == ',') { at++; continue; }
                expect('}');
                return m;
            }
        }

        List<Object> array(int depth) {
            List<Object> l = new ArrayList<>();
            expect('[');
            skipSpace();
            if (peek() == ']') { at++; return l; }
            while (true) {
                skipSpace();
                l.add(value(depth + 1));
                skipSpace();
                if (peek() == ',') { at++; continue; }
                expect(']');
                return l;
            }
        }

        String string() {
            expect('"');
            StringBuilder out = new StringBuilder();
            while (true) {
                char c = peek();
                at++;
                if (c == '"') return out.toString();
                if (c < 0x20) throw error("control character in a string");
                if (c != '\\') { out.append(c); continue; }
                char e = peek();
                at++;
                switch (e) {
                    case '"', '\\', '/' -> out.append(e);
                    case 'n' -> out.append('\n');
                    case 'r' -> out.append('\r');
                    case 't' -> out.append('\t');
                    case 'b' -> out.append('\b');
                    case 'f' -> out.append('\f');
                    case 'u' -> {   // a surrogate pair arrives as two escapes and joins in the builder
                        int unit = 0;
                        for (int i = 0; i < 4; i++) {
                            int digit = "0123456789abcdef".indexOf(Character.toLowerCase(peek()));
                            if (digit < 0) throw error("bad \\u escape");
                            unit = unit * 16 + digit;
                            at++;
                        }
                        out.append((char) unit);
                    }
                    default -> throw error("bad escape \\" + e);
                }
            }
        }

        Object number() {
            Matcher m = NUMBER.matcher(text).region(at, text.length());
            if (!m.lookingAt()) throw error("bad number");
            at = m.end();
            BigDecimal d = new BigDecimal(m.group());
            try {
                return m.group(1) == null && m.group(2) == null ? (Object) d.longValueExact() : d;
            } catch (ArithmeticException tooBig) {
                return d;
            }
        }

        static final Pattern NUMBER = Pattern.compile("-?(?:0|[1-9]\\d*)(\\.\\d+)?([eE][+-]?\\d+)?");
    }
}
