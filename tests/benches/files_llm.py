# A scripted OpenAI-compatible chat server (non-streaming) for timing what `tandem run` keeps:
# the first reply is a python block that writes COUNT files of SIZE bytes, the second says
# TERMINATE.
#
#   python3 tests/benches/files_llm.py PORT COUNT SIZE &
#   tandem run --no-stream --base-url http://127.0.0.1:PORT/v1 --model m -e local write
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

CODE = """```python
import os
os.makedirs('out', exist_ok=True)
blob = os.urandom(%d)
for i in range(%d):
    open(f'out/f{i:04d}.bin', 'wb').write(blob)
print('wrote')
```"""

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        turns = sum(1 for m in body['messages'] if m['role'] == 'assistant')
        text = CODE % (SIZE, COUNT) if turns == 0 else 'Done.\nTERMINATE'
        resp = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        data = json.dumps(resp).encode()
        self.send_response(200); self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)

COUNT, SIZE = int(sys.argv[2]), int(sys.argv[3])
HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
