{{/* Behind a Gateway API inference gateway (gateway.enabled): the gateway asks `tandem epp` (ext_proc, the
endpoint picker protocol) which pair serves each request and sends it to the chosen decode pod's pair sidecar
(the pool's target port), naming the prefill in x-prefiller-host-port; the sidecar runs the PD exchange with
that prefill and its own decode on 127.0.0.1. */}}

{{/* How the EPP finds the pool, with the router's discovery flags (router-deployment.yaml): the prefills at their
HTTP port, the decodes at their pair sidecar's (the pool's endpoints: the sidecar answers /health, /metrics and
/get_server_info for its decode). */}}
{{- define "tandem.gateway.discoveryArgs" -}}
- --prefill-discovery
- {{ printf "%s:%d" (include "tandem.serviceHost" (dict "root" . "component" "prefill")) (int .Values.engine.port) }}
- --decode-discovery
- {{ printf "%s:%d" (include "tandem.serviceHost" (dict "root" . "component" "decode")) (int .Values.gateway.sidecar.port) }}
- --discovery-interval-s
- {{ .Values.router.discoveryIntervalSeconds | quote }}
- --prefill-bootstrap-port
- {{ .Values.bootstrap.port | quote }}
{{- if .Values.bootstrap.standalone.enabled }}
- --prefill-bootstrap-host
- {{ include "tandem.serviceHost" (dict "root" . "component" "bootstrap") }}
{{- end }}
{{- end -}}

{{/* TANDEM_EPP_WORKER_API_KEY: the key the EPP sends to the workers (auth.apiKey's Secret). */}}
{{- define "tandem.gateway.eppKeyEnv" -}}
{{- with .Values.auth.apiKey.existingSecret }}
- name: TANDEM_EPP_WORKER_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.apiKey.key }}
{{- end }}
{{- end -}}

{{/* The pair sidecar of a decode pod: a native sidecar (an initContainer that keeps running), so the kubelet
stops it only after the decode has drained and exited. It learns each prefill's registry from the prefill itself;
TANDEM_API_KEY: the key it asks of the gateway's requests and sends to the prefill and its decode. */}}
{{- define "tandem.gateway.sidecar" -}}
{{- $g := .Values.gateway }}
- name: pair-sidecar
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  restartPolicy: Always
  command: ["tandem"]
  args:
    - sidecar
    - --decode
    - {{ printf "http://127.0.0.1:%d" (int .Values.engine.port) }}
    - --host
    - 0.0.0.0
    - --port
    - {{ $g.sidecar.port | quote }}
    {{- range $g.sidecar.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- with (include "tandem.apiKeyEnv" . | trim) }}
  env:
    {{- . | nindent 4 }}
  {{- end }}
  ports:
    - name: pair
      containerPort: {{ $g.sidecar.port }}
  readinessProbe:
    httpGet:
      path: /health # its decode's
      port: pair
    periodSeconds: 5
  {{- with $g.sidecar.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* What the gateway path cannot serve yet, refused with one line. */}}
{{- define "tandem.gateway.check" -}}
{{- if .Values.tls.enabled }}
{{- fail "gateway.enabled: the EPP and the pair sidecar do not speak TLS to the servers yet; set tls.enabled=false or gateway.enabled=false" }}
{{- end }}
{{- end -}}
