{{/* Behind a Gateway API inference gateway (gateway.enabled): the gateway asks `tandem epp` (ext_proc, the
endpoint picker protocol) which pair serves each request and sends it to the chosen decode pod's pair sidecar
(the pool's target port), naming the prefill in x-prefiller-host-port; the sidecar runs the PD exchange with
that prefill and its own decode on 127.0.0.1. */}}

{{/* The EPP's and the sidecar's flags that find the workers, the router's own (router-deployment.yaml). */}}
{{- define "tandem.gateway.discoveryArgs" -}}
- --prefill-discovery
- {{ printf "%s:%d" (include "tandem.serviceHost" (dict "root" . "component" "prefill")) (int .Values.engine.port) }}
- --decode-discovery
- {{ printf "%s:%d" (include "tandem.serviceHost" (dict "root" . "component" "decode")) (int .Values.engine.port) }}
- --discovery-interval-s
- {{ .Values.router.discoveryIntervalSeconds | quote }}
{{ include "tandem.gateway.bootstrapArgs" . }}
{{- end -}}

{{/* Where a prefill's bootstrap registry is: its own port, or the standalone registry. */}}
{{- define "tandem.gateway.bootstrapArgs" -}}
- --prefill-bootstrap-port
- {{ .Values.bootstrap.port | quote }}
{{- if .Values.bootstrap.standalone.enabled }}
- --prefill-bootstrap-host
- {{ include "tandem.serviceHost" (dict "root" . "component" "bootstrap") }}
{{- end }}
{{- end -}}

{{/* The pair sidecar of a decode pod: a native sidecar (an initContainer that keeps running), so the kubelet
stops it only after the decode has drained and exited. */}}
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
    {{- include "tandem.gateway.bootstrapArgs" . | nindent 4 }}
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
    tcpSocket:
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
